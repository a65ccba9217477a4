"""The integrity manifest: size and blake2b checksum of every file of a checkpoint, written when it is committed.

Pure Python (no torch): ``lightning-hpz checkpoint inspect`` and ``consolidate`` read it without starting a run.
blake2b from hashlib is used rather than xxhash: no new dependency, and hashing runs at disk speed on this hardware
(see docs/checkpoints.md for the measured seconds per GB).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Optional

MANIFEST_NAME = "hpz_manifest.json"
MANIFEST_FORMAT = 1
UNIVERSAL_DIR = "universal"  # the converted copy for other world sizes (universal.py)
LATEST_NAME = "latest"  # DeepSpeed's file naming the tag to load
DEEPSPEED_TAG = "checkpoint"  # the tag Lightning's DeepSpeedStrategy saves under: <ckpt>/checkpoint/*.pt
_CHUNK = 8 << 20
OPTIMIZER_SUFFIX = "optim_states.pt"  # DeepSpeed's optimizer shards: [bf16_]zero_pp_rank_<r>_mp_rank_00_...
_RANK_IN_NAME = re.compile(r"zero_pp_rank_(\d+)_")


def file_digest(path: Path) -> dict[str, Any]:
    """Size in bytes and blake2b-128 hex digest of one file."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as stream:
        while chunk := stream.read(_CHUNK):
            digest.update(chunk)
    return {"size": path.stat().st_size, "blake2b": digest.hexdigest()}


def buffer_digest(data: Any) -> dict[str, Any]:
    """:func:`file_digest` of bytes already in memory (or mapped): a ``bytes``-like object or an ``mmap``."""
    view, digest = memoryview(data), hashlib.blake2b(digest_size=16)
    for start in range(0, len(view), _CHUNK):
        digest.update(view[start : start + _CHUNK])
    return {"size": len(view), "blake2b": digest.hexdigest()}


def digest_problem(where: Any, expected: dict[str, Any], found: dict[str, Any]) -> str:
    """'' when ``found`` (size and blake2b) is what the manifest ``expected``, else one sentence saying both."""
    if found == {"size": expected["size"], "blake2b": expected["blake2b"]}:
        return ""
    return (
        f"{where}: expected {expected['size']} bytes with blake2b {expected['blake2b']}, "
        f"found {found['size']} bytes with blake2b {found['blake2b']}"
    )


def checkpoint_files(checkpoint_dir: Path) -> list[str]:
    """Every file DeepSpeed wrote for the checkpoint that a resume reads, relative to ``checkpoint_dir``, sorted: the
    tag folder's, and ``latest`` (the tag a resume opens)."""
    names = []
    for folder, _, files in os.walk(Path(checkpoint_dir) / DEEPSPEED_TAG):  # the listing's file types: no stat each
        names += [os.path.relpath(os.path.join(folder, name), checkpoint_dir) for name in files]
    return sorted(names + [LATEST_NAME] * (Path(checkpoint_dir) / LATEST_NAME).is_file())


def files_written_by(checkpoint_dir: Path, rank: int, world_size: int) -> list[str]:
    """The files ``rank`` wrote itself (its ``zero_pp_rank_<rank>_`` shards; rank 0 also the shared ones)."""
    owned = []
    for name in checkpoint_files(checkpoint_dir):
        match = _RANK_IN_NAME.search(Path(name).name)
        if (int(match.group(1)) if match else 0) % world_size == rank:
            owned.append(name)
    return owned


def files_read_by_each(names: list[str], world_size: int, every_optimizer_shard: bool = False) -> list[list[str]]:
    """Of a checkpoint's ``names``, those each rank reads when it resumes on the same number of ranks, by rank: its
    own shards (``zero_pp_rank_<rank>_``) and the shared files (no rank in the name: ``latest``, ZeRO-1/2's model
    states). DeepSpeed only checks that the other ranks' optimizer shards exist, unless ZeRO's ``elastic_checkpoint``
    (``every_optimizer_shard``) has every rank read them all."""
    shared, own = [], [[] for _ in range(world_size)]
    for name in names:
        match = _RANK_IN_NAME.search(Path(name).name)
        if match is None or (every_optimizer_shard and name.endswith(OPTIMIZER_SUFFIX)):
            shared.append(name)
        else:
            own[int(match.group(1)) % world_size].append(name)  # a rank beyond the world: still verified
    return [sorted(shared + mine) for mine in own]


def digests(checkpoint_dir: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    return {name: file_digest(checkpoint_dir / name) for name in names}


def write_manifest(checkpoint_dir: Path, files: dict[str, dict[str, Any]], run: dict[str, Any]) -> Path:
    """Write the manifest atomically (temporary file, fsync, rename): it exists complete or not at all."""
    manifest = {"format": MANIFEST_FORMAT, "tag": DEEPSPEED_TAG, "run": run, "files": dict(sorted(files.items()))}
    target = checkpoint_dir / MANIFEST_NAME
    partial = target.with_suffix(".json.partial")
    with open(partial, "w") as stream:
        json.dump(manifest, stream, indent=1)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(partial, target)
    return target


def read_manifest(checkpoint_dir: Path) -> Optional[dict[str, Any]]:
    """The manifest, or None for a checkpoint written without one (before lightning_hpz wrote manifests)."""
    path = Path(checkpoint_dir) / MANIFEST_NAME
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def file_problem(checkpoint_dir: Path, name: str, expected: dict[str, Any], hash_contents: bool = True) -> str:
    """'' when ``name`` matches its manifest entry, else one sentence naming the file, expected and found."""
    path = checkpoint_dir / name
    if not path.is_file():
        return f"{path}: missing (manifest expects {expected['size']} bytes, blake2b {expected['blake2b']})"
    size = path.stat().st_size
    if size == expected["size"] and not hash_contents:
        return ""
    return digest_problem(path, expected, file_digest(path))


def verify_files(
    checkpoint_dir: Path, manifest: dict[str, Any], names: list[str], hash_contents: bool = True
) -> list[str]:
    """One sentence per damaged or missing file among ``names`` (files of ``manifest``)."""
    entries = manifest["files"]
    return [p for p in (file_problem(checkpoint_dir, n, entries[n], hash_contents) for n in names) if p]


def complete_manifest(checkpoint_dir: Path) -> Optional[dict[str, Any]]:
    """The manifest of ``checkpoint_dir`` if it has one and every file it lists has its recorded size, else None."""
    recorded = read_manifest(checkpoint_dir)
    if recorded and not verify_files(checkpoint_dir, recorded, list(recorded["files"]), hash_contents=False):
        return recorded
    return None


def last_good_checkpoint(checkpoint_dir: Path) -> Optional[Path]:
    """The newest other committed checkpoint beside ``checkpoint_dir`` whose files all have their recorded sizes."""
    checkpoint_dir = Path(checkpoint_dir).resolve()
    candidates = []
    for sibling in checkpoint_dir.parent.iterdir():
        if sibling == checkpoint_dir or not sibling.is_dir():
            continue
        try:
            manifest = complete_manifest(sibling)
            if manifest:
                candidates.append(
                    (manifest["run"].get("global_step", -1), (sibling / MANIFEST_NAME).stat().st_mtime, sibling)
                )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):  # damaged or vanishing: not a candidate
            continue
    return max(candidates)[2] if candidates else None


def saved_world_from_names(checkpoint_dir: Path) -> dict[str, Any]:
    """What the file names alone tell of a checkpoint without manifest: world size and whether it is ZeRO-3."""
    names = [Path(n).name for n in checkpoint_files(checkpoint_dir)]
    optimizer_shards = [n for n in names if n.endswith(OPTIMIZER_SUFFIX)]
    stage_3 = any(n.startswith("zero_pp_rank_") and n.endswith("model_states.pt") for n in names)
    return {"world_size": len(optimizer_shards) or None, "stage_3": stage_3}


def damage_report(checkpoint_dir: Path, problems: list[str]) -> str:
    """The refusal message for a damaged checkpoint: every bad file, and where to resume instead."""
    checkpoint_dir = Path(checkpoint_dir)
    good = last_good_checkpoint(checkpoint_dir)
    fallback = (
        f"The last good checkpoint in {checkpoint_dir.parent} is {good}: resume from it (ckpt_path={str(good)!r})."
        if good
        else f"There is no other intact checkpoint in {checkpoint_dir.parent}."
    )
    return f"Checkpoint {checkpoint_dir} is damaged, refusing to load it. " + "; ".join(problems) + ". " + fallback


def unreadable_archives(checkpoint_dir: Path) -> list[str]:
    """Files of a checkpoint without manifest that are not intact zip archives (torch.save's format, CRC-checked)."""
    import zipfile

    bad = []
    for name in checkpoint_files(Path(checkpoint_dir)):
        if not name.endswith(".pt"):
            continue
        path = Path(checkpoint_dir) / name
        try:
            with zipfile.ZipFile(path) as archive:
                damaged_member = archive.testzip()
        except (zipfile.BadZipFile, OSError) as error:
            bad.append(f"{path}: not a complete archive ({error})")
            continue
        if damaged_member is not None:
            bad.append(f"{path}: checksum error in {damaged_member}")
    return bad
