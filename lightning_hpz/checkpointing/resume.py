"""Before DeepSpeed reads a checkpoint: verify its files, compare it with this run, and pick how to load it.

Every decision here is agreed over all ranks before anyone raises, so a refused checkpoint gives every rank the same
message instead of one rank's traceback and the others' "Connection closed by peer".
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_hpz import lightning_internals
from lightning_hpz.checkpointing import commit, commit_repair, compatibility, manifest, universal
from lightning_hpz.checkpointing.errors import CheckpointIntegrityError, CheckpointMismatchError
from lightning_hpz.checkpointing.rank_agreement import (
    agreed,
    dealt_by_rank_zero,
    manifest_shares,
    on_rank_zero,
    problems_found_together,
    verification_shares,
)

NO_MANIFEST_WARNING = (
    "Checkpoint {path} has no integrity manifest (written before lightning_hpz wrote one): loading it unverified."
)


def prepare_load(
    strategy: Any, checkpoint_path: Any, module: Any, engine: Any, keep_data_order: bool
) -> tuple[Path, contextlib.AbstractContextManager]:
    """The directory DeepSpeed should load into ``engine``, and the context to load it in; raises on every rank if it
    must not. ``module`` holds the parameters by the names the manifest records (see ``compatibility.describe_run``);
    ``keep_data_order``: the resume must repeat the data order, so another number of ranks is refused.

    The one load path of the Trainer's and Fabric's strategies. On the same number of ranks each rank checksums only
    the files it will read (:func:`_own_files_verified`), and DeepSpeed reads them from the mappings that were hashed.
    """
    commit.wait_for_old_copy_deletion()  # a load right after a save (`fit`, then `test`) meets no half-deleted copy
    path = Path(checkpoint_path)
    commit_repair.repair_before_load(path)  # a path caught between the two renames of its commit exists again
    # Lightning's own check first: a wrong path gets its guidance (a subfolder or a file inside a checkpoint: "try
    # to load using this parent directory instead"), the same FileNotFoundError as with Lightning's strategy
    lightning_internals.validate_checkpoint_directory(path)
    current = compatibility.describe_run(strategy, module, engine)
    every_shard = bool(strategy.config.get("zero_optimization", {}).get("elastic_checkpoint"))
    dealt = dealt_by_rank_zero(lambda: _manifest_dealt(path, current, every_shard))
    saved, entries = dealt["run"], dealt["files"]
    same_world = saved.get("world_size") in (None, current["world_size"])
    mappings, verified = contextlib.ExitStack(), {}
    with _closed_on_error(mappings):
        if entries is None:
            rank_zero_warn(NO_MANIFEST_WARNING.format(path=path))
        elif same_world:
            verified = _own_files_verified(path, entries, mappings)
        else:  # converted for this number of ranks: every file is read, a share by each rank
            verify_integrity(path, entries)
        refuse_mismatches(path, dealt["mismatches"], saved, current, strategy)
    if same_world:
        return path, _verifying_reads(strategy, engine, path, entries, verified, mappings)
    # the optimizer first: no setting makes its state convertible, while the data order is one flag away
    refuse_unconvertible_optimizer(path, saved)
    refuse_inexact_resize(path, saved["world_size"], current["world_size"], keep_data_order)
    rank_zero_warn(universal.DATA_ORDER_WARNING.format(saved=saved["world_size"], current=current["world_size"]))
    copy = universal.universal_copy(path)
    verify_universal_copy(copy)
    return copy, _universal_resume(strategy, engine, saved.get("param_groups"))


def _manifest_dealt(path: Path, current: dict[str, Any], every_optimizer_shard: bool) -> list[dict[str, Any]]:
    """On rank 0: what each rank needs of the manifest, by rank (:func:`_dealt`), with the entries of the files it
    verifies: those it reads on the same number of ranks, else a share of all. Read once, on one rank: N ranks opening
    one file of O(F) bytes at once would load the metadata server, and each rank's memory with O(N)."""
    world_size = current["world_size"]
    try:
        recorded = manifest.read_manifest(path)
        if recorded is None:
            return _dealt(_saved_run_without_manifest(path), current, [None] * world_size)
        # every entry checked here, once: one malformed would otherwise fail on the rank it is dealt to alone
        files = {name: {"size": int(e["size"]), "blake2b": str(e["blake2b"])} for name, e in recorded["files"].items()}
        if recorded["run"].get("world_size") in (None, world_size):
            names = manifest.files_read_by_each(list(files), world_size, every_optimizer_shard)
        else:
            names = verification_shares(recorded, world_size)
        return _dealt(recorded["run"], current, [{name: files[name] for name in share} for share in names])
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as error:  # cut short, not JSON
        problem = f"{path / manifest.MANIFEST_NAME}: cannot be read ({type(error).__name__}: {error})"
        raise CheckpointIntegrityError(manifest.damage_report(path, [problem])) from None


def _dealt(saved: dict[str, Any], current: dict[str, Any], files: list[Any]) -> list[dict[str, Any]]:
    # the saved run's few fields a rank acts on, and its differences from this run found here once: the description
    # itself (a shape per parameter tensor) stays on rank 0, and the ranks need no collective to agree on a refusal
    run = {key: saved.get(key) for key in ("world_size", "optimizer", "param_groups")}
    problems = compatibility.mismatches(saved, current)
    return [{"run": run, "mismatches": problems, "files": part} for part in files]


@contextlib.contextmanager
def _closed_on_error(stack: contextlib.ExitStack) -> Iterator[None]:
    try:
        yield
    except BaseException:
        stack.close()
        raise


def _own_files_verified(path: Path, entries: dict[str, Any], mappings: contextlib.ExitStack) -> dict[str, Any]:
    """Collective: each rank checksums the files it will read (``entries``, by name: its own shards and the shared
    ones, never another rank's), keeping each mapped for the load; a damaged one is refused on every rank alike. The
    mappings by name."""
    verified, problems = {}, []
    for name, expected in entries.items():
        try:
            with open(path / name, "rb") as stream:
                if not expected["size"] or os.fstat(stream.fileno()).st_size != expected["size"]:
                    problem = manifest.file_problem(path, name, expected)  # nothing to map, or its size says so
                else:
                    mapping = mappings.enter_context(mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ))
                    problem = manifest.digest_problem(path / name, expected, manifest.buffer_digest(mapping))
                    verified[name] = mapping
        except FileNotFoundError:
            problem = manifest.file_problem(path, name, expected)  # named as missing
        except (OSError, ValueError) as error:  # raised on this rank alone, the others would wait in the agreement
            problem = f"{path / name}: cannot be read ({error})"
        if problem:
            problems.append(problem)
    problems = agreed(problems)  # one all-reduce of a number when every file verified
    if problems:
        raise CheckpointIntegrityError(_same_on_every_rank(lambda: manifest.damage_report(path, problems)))
    return verified


def verify_universal_copy(copy: Path) -> None:
    """Each rank checksums a share of the converted copy's files against the manifest written with it, sent by rank 0;
    a damaged copy is refused on every rank, saying how to convert it again."""
    share = manifest_shares(copy)
    if share is None:  # converted by a version that wrote no manifest: nothing to check it against
        rank_zero_warn(f"The universal-format copy {copy} has no manifest; it is loaded unverified. Delete it to have "
                       "it converted (and sealed with a manifest) again.")  # fmt: skip
        return
    problems = problems_found_together(copy, share)
    if problems:
        raise CheckpointIntegrityError(
            f"The universal-format copy {copy} is damaged: {'; '.join(problems)}. Delete {copy} and resume again: "
            "the checkpoint it was converted from is converted anew."
        )


@contextlib.contextmanager
def _verifying_reads(
    strategy: Any, engine: Any, path: Path, entries: Any, verified: dict[str, Any], mappings: contextlib.ExitStack
) -> Iterator[None]:
    """Each file DeepSpeed reads into ``engine`` is read from its ``verified`` mapping, or checked as it is read (a
    file this rank was not expected to read); the strategy's ``files_verified_in_load`` then names them, in the order
    they were read. The mappings are closed after the load."""
    from lightning_hpz.partitioning import verifying_reads

    entry = _entry_lookup(path, entries) if entries is not None else None
    size_of = (lambda name: (entry(name) or {}).get("size")) if entry else None
    check = functools.partial(_check_loaded_bytes, path, entry)
    with mappings, verifying_reads(engine, path, size_of, check, verified) as reads:
        yield
    strategy.files_verified_in_load = reads.verified if reads is not None else []


def _entry_lookup(path: Path, entries: dict[str, Any]) -> Any:
    """``name -> manifest entry`` (None if unlisted): those rank 0 sent, else read from the manifest on this rank. A
    file DeepSpeed reads that the split did not predict costs this rank the whole manifest once, and is still
    checked: never loaded unverified."""
    whole = functools.cache(lambda: _manifest_read_here(path)["files"])
    return lambda name: entries[name] if name in entries else whole().get(name)


def _manifest_read_here(path: Path) -> dict[str, Any]:
    recorded = manifest.read_manifest(path)
    if recorded is None:  # gone since rank 0 read it: what this file must hash to is unknown, so it is not loaded
        raise CheckpointIntegrityError(f"{path / manifest.MANIFEST_NAME} disappeared while {path} was being loaded.")
    return recorded


def _check_loaded_bytes(path: Path, entry: Any, name: str, data: Any) -> None:
    problem = manifest.digest_problem(path / name, entry(name), manifest.buffer_digest(data))
    if problem:
        raise CheckpointIntegrityError(
            f"Checkpoint file changed between its verification and its load: {problem}. Another process may be "
            f"writing {path}, or its storage returns inconsistent data; load it again once nothing else writes it, "
            "or resume from an earlier checkpoint."
        )


@contextlib.contextmanager
def _universal_resume(strategy: Any, engine: Any, groups: Any) -> Iterator[None]:
    """Load the universal copy, each rank reading its own part of it; the strategy's ``universal_reads`` then says
    how many bytes this rank copied, and whether DeepSpeed read whole files instead (and why)."""
    from lightning_hpz.partitioning.universal_load import universal_loading

    with universal_loading(engine) as reads:
        yield
    strategy.universal_reads = reads
    # DeepSpeed's universal loader gives every group the first group's settings under ZeRO-3 (a no-decay group gets
    # weight decay); the checkpoint's manifest recorded each group's own
    universal.restore_group_settings(engine.optimizer, groups)


def refuse_unconvertible_optimizer(path: Path, saved: dict[str, Any]) -> None:
    """A resize converts Adam's two moments and nothing else: any other optimizer, or Adam with AMSGrad (whose
    running maximum of the second moment the conversion drops), is refused, named."""
    name = saved.get("optimizer")
    amsgrad = any(group.get("amsgrad") for group in saved.get("param_groups") or [])
    if name is not None and (name not in universal.CONVERTIBLE_OPTIMIZERS or amsgrad):
        held = f"{name}(amsgrad=True)" if amsgrad else name
        raise CheckpointMismatchError(
            f"Cannot resume {path} on another number of ranks: it holds {held} state, and the conversion carries only "
            f"Adam's two moments ({', '.join(sorted(universal.CONVERTIBLE_OPTIMIZERS))}, without AMSGrad). Resume on "
            f"{saved.get('world_size')} ranks, or start the optimizer afresh from the weights "
            "(load them with `load_full_weights`)."
        )


def refuse_inexact_resize(path: Path, saved: int, current: int, keep_data_order: bool) -> None:
    """A resume that must repeat the data order (the Trainer's ``fit`` under ``exact_resume=True``) cannot on another
    number of ranks. Evaluation from a checkpoint has no order to keep, and a Fabric loop owns its own."""
    if keep_data_order:
        raise CheckpointMismatchError(
            f"Cannot resume {path} exactly: it was written on {saved} ranks and this run has {current}, so each global "
            f"batch would hold {current} per-rank batches instead of {saved} and the data order from here on would "
            f"differ. Resume on {saved} ranks, or pass HpzStrategy(exact_resume=False) to resume with weights, "
            "optimizer state and step counters exact and the data order changed."
        )


def verify_integrity(path: Path, share: dict[str, Any]) -> None:
    """Each rank checksums its ``share`` of the files (from rank 0); the damaged ones, gathered, are reported by every
    rank alike."""
    problems = problems_found_together(path, share)
    if problems:
        raise CheckpointIntegrityError(_same_on_every_rank(lambda: manifest.damage_report(path, problems)))


def refuse_mismatches(
    path: Path, problems: list[str], saved: dict[str, Any], current: dict[str, Any], strategy: Any
) -> None:
    """Raise the ``problems`` rank 0 found between the ``saved`` run and this one (the same list on every rank), and a
    resize of optimizer state offloaded to NVMe."""
    problems = list(problems)
    if saved.get("world_size") not in (None, current["world_size"]) and _offloads_to_nvme(strategy):
        problems.append(
            f"world size: the checkpoint was written on {saved['world_size']} ranks, this run has "
            f"{current['world_size']}, and optimizer state offloaded to NVMe cannot be converted. Resume on "
            f"{saved['world_size']} ranks."
        )
    if problems:
        raise CheckpointMismatchError(f"Cannot resume {path} in this run: " + " ".join(problems))


def _same_on_every_rank(build: Any) -> str:
    # the report reads sibling checkpoints on rank 0: an error there reaches every rank, none waits in a broadcast
    return on_rank_zero(build, "Checkpoint refused, and its damage could not be described", errors=(Exception,))


def _saved_run_without_manifest(path: Path) -> dict[str, Any]:
    # File names tell the world size and whether it was ZeRO-3; stage 1 vs 2 and shapes are left to DeepSpeed.
    names = manifest.saved_world_from_names(path)
    return {"world_size": names["world_size"], "stage": 3 if names["stage_3"] else None}


def _offloads_to_nvme(strategy: Any) -> bool:
    offload = strategy.config.get("zero_optimization", {}).get("offload_optimizer") or {}
    return offload.get("device") == "nvme"
