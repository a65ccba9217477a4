"""``lightning-hpz checkpoint inspect CKPT_DIR``: what a checkpoint holds and whether it is intact, without torch.

Reads the integrity manifest (stage, world size, step, optimizer, parameter shapes, file checksums); for a checkpoint
written without one, what its file names tell. Exits 1 when a file is damaged or missing.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from lightning_hpz.checkpointing import manifest

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


DAMAGED_EXIT_CODE = 1
UNVERIFIABLE_EXIT_CODE = 2  # no manifest


def checkpoint_main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="lightning-hpz checkpoint", description="tools for sharded checkpoints")
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="stage, world size, step, manifest status and sizes")
    inspect.add_argument("checkpoint_dir", help="a .ckpt directory written by ModelCheckpoint under HpzStrategy")
    inspect.add_argument("--no-checksums", action="store_true", help="compare file sizes only (fast on large runs)")
    convert = commands.add_parser(
        "convert",
        help="write the universal-format copy a resume on another number of ranks needs, ahead of the run (an "
        "interrupted conversion resumes when run again)",
    )
    convert.add_argument("checkpoint_dir", help="a .ckpt directory written by ModelCheckpoint under HpzStrategy")
    convert.add_argument("--cache", help="write the copy here (a folder every rank sees), not inside the checkpoint")
    args = parser.parse_args(list(argv))
    if args.command == "convert":
        from lightning_hpz.checkpointing.convert_command import convert_checkpoint

        print(convert_checkpoint(Path(args.checkpoint_dir), Path(args.cache) if args.cache else None))
        return
    lines, intact = inspect_checkpoint(Path(args.checkpoint_dir), checksums=not args.no_checksums)
    print("\n".join(lines))
    if intact is None:  # nothing to verify against: a script must not take it for a verified checkpoint
        raise SystemExit(UNVERIFIABLE_EXIT_CODE)
    if not intact:
        raise SystemExit(DAMAGED_EXIT_CODE)


def inspect_checkpoint(checkpoint_dir: Path, checksums: bool = True) -> tuple[list[str], Optional[bool]]:
    """Lines describing ``checkpoint_dir``, and whether every file matches its manifest (None: it has none)."""
    from lightning_hpz.checkpointing.consolidate import validate_checkpoint_dir

    checkpoint_dir = validate_checkpoint_dir(checkpoint_dir)
    recorded = manifest.read_manifest(checkpoint_dir)
    lines = [_row("checkpoint", str(checkpoint_dir))]
    if recorded is None:
        return lines + _without_manifest(checkpoint_dir), None
    problems = manifest.verify_files(checkpoint_dir, recorded, list(recorded["files"]), hash_contents=checksums)
    run = recorded["run"]
    checked = "checksums" if checksums else "sizes"
    lines += [
        _row("manifest", f"committed, {len(recorded['files'])} files"),
        _row("integrity", f"ok ({checked} match)" if not problems else "DAMAGED: " + "; ".join(problems)),
        _row("ZeRO stage", str(run.get("stage"))),
        _row("world size", f"{run.get('world_size')} ranks (hpZ partition size {run.get('hpz_partition_size')})"),
        _row("step", f"{run.get('global_step')} (epoch {run.get('epoch')})"),
        _row("optimizer", str(run.get("optimizer"))),
        _row("parameters", _parameter_summary(run.get("parameters") or {})),
    ]
    lines += _size_rows({name: entry["size"] for name, entry in recorded["files"].items()})
    converted = (checkpoint_dir / manifest.UNIVERSAL_DIR).is_dir()
    lines.append(_row("universal", "converted copy cached" if converted else "none"))
    return lines, not problems


def _without_manifest(checkpoint_dir: Path) -> list[str]:
    names = manifest.saved_world_from_names(checkpoint_dir)
    sizes = {name: (checkpoint_dir / name).stat().st_size for name in manifest.checkpoint_files(checkpoint_dir)}
    lines = [
        _row("manifest", "none (written before lightning_hpz wrote manifests): not verifiable"),
        _row("ZeRO stage", "3" if names["stage_3"] else "1 or 2 (from the file names)"),
        _row("world size", f"{names['world_size']} ranks (from the optimizer shards)"),
        _row("step", "unknown without manifest"),
    ]
    return lines + _size_rows(sizes)


def _size_rows(sizes: dict[str, int]) -> list[str]:
    model = [s for n, s in sizes.items() if n.endswith("model_states.pt")]
    optim = [s for n, s in sizes.items() if n.endswith(manifest.OPTIMIZER_SUFFIX)]
    return [
        _row("size", f"{_human(sum(sizes.values()))} in {len(sizes)} files"),
        _row("model states", f"{_human(sum(model))} in {len(model)} files"),
        _row("optim states", f"{_human(sum(optim))} in {len(optim)} shards"),
    ]


def _parameter_summary(parameters: dict[str, Any]) -> str:
    elements = 0
    for shape in parameters.values():
        count = 1
        for dim in shape:
            count *= dim
        elements += count
    return f"{len(parameters)} tensors, {elements:,} elements"


def _human(size: float) -> str:
    for unit in _UNITS:
        if size < 1024 or unit == _UNITS[-1]:
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return ""


def _row(label: str, value: str) -> str:
    return f"{label:<13}{value}"
