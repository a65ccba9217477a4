"""Resume on a different number of ranks: convert the checkpoint once to DeepSpeed's universal format, cached in it.

ZeRO shards the fp32 weights and optimizer moments by data-parallel rank; DeepSpeed refuses to load them on another
world size. ``deepspeed.checkpoint.ds_to_universal`` merges the shards into one file per parameter and state
(``fp32``, ``exp_avg``, ``exp_avg_sq``), which any world size then re-shards on load. Weights, optimizer moments and
step counters move exactly; the order of the data does not when the global batch changes (see ``DATA_ORDER_WARNING``).

The converted copy lives in ``<ckpt>/universal`` (or, for a checkpoint that cannot be written, in the cache folder of
:mod:`~lightning_hpz.checkpointing.universal_location`). It is written into ``universal.partial`` and renamed when
complete, so a finished copy is reused. Every rank of the job shares the work
(:mod:`~lightning_hpz.partitioning.resumable_conversion`): rank 0 runs DeepSpeed's converter and hands each phase's
items out through the job's key-value store; rank ``r`` extracts ZeRO shard ``r`` (every ``N``-th one when the world
sizes differ) and merges every ``N``-th parameter, and digests the files it merged for the copy's manifest. The store,
not a collective, carries the hand-outs and the waits: a 70B checkpoint converts for longer than the process group's
timeout. An interrupted conversion resumes: ``universal.partial`` keeps a record of each ZeRO shard extracted and each
parameter merged, and the next attempt skips them. A 70B checkpoint does not lose hours to a preemption this way.
``universal.partial`` also records which checkpoint (and which DeepSpeed) it belongs to, and a partial copy of
anything else is discarded.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import itertools
import json
import os
import shutil
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_hpz import collectives, durability
from lightning_hpz.checkpointing import manifest
from lightning_hpz.checkpointing.errors import CheckpointMismatchError
from lightning_hpz.checkpointing.fault_points import CONVERSION_ITEM_WRITTEN, fault_point
from lightning_hpz.checkpointing.manifest import DEEPSPEED_TAG, MANIFEST_NAME, UNIVERSAL_DIR
from lightning_hpz.checkpointing.universal_location import universal_location

if TYPE_CHECKING:
    from lightning_hpz.partitioning.resumable_conversion import ConversionProgress, Team

DATA_ORDER_WARNING = (
    "Resuming a checkpoint written on {saved} ranks on {current} ranks: weights, optimizer moments and step counters "
    "are restored exactly, but a global batch now holds {current} per-rank batches instead of {saved}, so the samples "
    "each step sees and the data order from here on differ from the original run."
)


CONVERSION_WAIT = timedelta(hours=24)  # how long a rank waits for the others' part of a conversion
_ASKED = itertools.count()
# in the partial copy, beside DeepSpeed's output: what it is a copy of, and the record of each unit of work done
SOURCE_RECORD = "conversion_source.json"
WORK_RECORDS = "done"
RECORDS_FORMAT = "2"  # merge records name their files from the partial copy, with digests; older ones are discarded


def universal_copy(checkpoint_dir: Path) -> Path:
    """The universal-format copy of ``checkpoint_dir`` (converted now by all ranks if absent), the same on all
    ranks."""
    failure = ""
    try:
        target = universal_location(Path(checkpoint_dir))
    except PermissionError as error:  # read-only and no cache folder: the same on every rank
        target, failure = Path(checkpoint_dir) / UNIVERSAL_DIR, str(error)
    team = _StoreTeam.for_job(target)
    if collectives.rank() == 0:
        try:
            if not failure and not target.is_dir():
                convert_to_universal(Path(checkpoint_dir), target, team=team)
        except Exception as error:  # reported identically on every rank below, instead of hanging the others
            failure = f"{type(error).__name__}: {error}"
        finally:
            if team is not None:
                team.hand_out(b"")  # no more work: the others go on to the outcome
    elif team is not None:
        from lightning_hpz.partitioning.resumable_conversion import work_share

        work_share(team)
    failure = _outcome_of_rank_zero(failure, team)
    if failure:
        raise CheckpointMismatchError(
            f"Could not convert {checkpoint_dir} to DeepSpeed's universal format to resume it on a different number "
            f"of ranks ({failure}). Resume on the number of ranks that wrote it."
        )
    return target


class _StoreTeam:
    """The job's ranks sharing one conversion, coordinated in its key-value store: per phase, each rank makes O(1)
    requests (rank 0 one hand-out and one wait; the others one wait, one read and one count)."""

    def __init__(self, store: Any, prefix: str, rank: int, size: int) -> None:
        self.store, self.prefix, self.rank, self.size = store, prefix, rank, size
        self._phases = itertools.count()

    @classmethod
    def for_job(cls, target: Path) -> Optional[_StoreTeam]:
        store = collectives.default_store()
        if store is None or collectives.world_size() == 1:
            return None
        # every rank asks once per resize, in the same order: the count names this one without a collective
        prefix = f"lightning_hpz/universal/{target}/{next(_ASKED)}"
        return cls(store, prefix, collectives.rank(), collectives.world_size())

    def hand_out(self, payload: bytes) -> int:
        phase = next(self._phases)
        self.store.set(f"{self.prefix}/phase{phase}", payload)
        return phase

    def take(self) -> Optional[tuple[int, bytes]]:
        phase = next(self._phases)
        key = f"{self.prefix}/phase{phase}"
        self.store.wait([key], CONVERSION_WAIT)
        payload = self.store.get(key)
        return (phase, payload) if payload else None

    def done(self, phase: int, failure: str) -> None:
        if failure:
            self.store.set(f"{self.prefix}/phase{phase}/failed", failure)
        if self.store.add(f"{self.prefix}/phase{phase}/done", 1) == self.size - 1:
            self.store.set(f"{self.prefix}/phase{phase}/all", "1")

    def wait(self, phase: int) -> str:
        self.store.wait([f"{self.prefix}/phase{phase}/all"], CONVERSION_WAIT)
        failed = f"{self.prefix}/phase{phase}/failed"
        return self.store.get(failed).decode() if self.store.check([failed]) else ""

    def outcome(self, failure: str) -> str:
        """Rank 0's outcome on every rank."""
        key = f"{self.prefix}/outcome"
        if self.rank == 0:
            self.store.set(key, failure or "ok")
        else:
            self.store.wait([key], CONVERSION_WAIT)
        outcome = self.store.get(key).decode()
        return "" if outcome == "ok" else outcome


def _outcome_of_rank_zero(failure: str, team: Optional[_StoreTeam]) -> str:
    """Rank 0's outcome on every rank, waited for in the job's store (no process-group timeout applies there)."""
    return failure if team is None else team.outcome(failure)


def convert_to_universal(
    checkpoint_dir: Path, target: Path, quiet: bool = True, team: Optional[Team] = None
) -> Optional[ConversionProgress]:
    """Convert into ``target`` (with the ranks of ``team`` sharing the work, this process being its rank 0),
    resuming a conversion of the same checkpoint interrupted earlier. Returns its
    :class:`~lightning_hpz.partitioning.resumable_conversion.ConversionProgress` (None: not resumable here)."""
    from deepspeed.checkpoint import ds_to_universal

    from lightning_hpz.partitioning import resumable_conversion

    partial = target.with_name(target.name + ".partial")
    _prepare_partial(partial, _source_of(checkpoint_dir), resumable_conversion.UNSUPPORTED_REASON)
    args = argparse.Namespace(
        input_folder=str(checkpoint_dir / DEEPSPEED_TAG),
        output_folder=str(partial / DEEPSPEED_TAG),
        num_extract_workers=1,  # the items run in this process (and the team's): a rank should not fork pools
        num_merge_workers=1,
        # DeepSpeed removes its fragments only once every parameter is merged: no later attempt needs them then
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # Lightning's ZeRO-1/2 checkpoints lack the universal-info block
    )
    with contextlib.ExitStack() as output:
        if quiet:  # its progress bars show otherwise (the convert command)
            output.enter_context(contextlib.redirect_stdout(io.StringIO()))
            output.enter_context(contextlib.redirect_stderr(io.StringIO()))
        records = partial / WORK_RECORDS
        progress = output.enter_context(resumable_conversion.resumable_work(records, _report, _item_written, team))
        ds_to_universal.main(args)
    (partial / "latest").write_text(DEEPSPEED_TAG)  # Lightning checks for it before handing the path to DeepSpeed
    # sealed while the records still say what it is: a kill while sealing resumes instead of converting anew
    _seal(partial, json.loads((partial / SOURCE_RECORD).read_text()), resumable_conversion.recorded_files(records))
    shutil.rmtree(partial / WORK_RECORDS, ignore_errors=True)  # none when the conversion was not resumable
    (partial / SOURCE_RECORD).unlink()
    partial.rename(target)
    durability.persist_directory(target.parent)
    return progress


def _seal(partial: Path, source: dict[str, str], digested: dict[str, Any]) -> None:
    """Make the finished copy durable and give it a manifest of its own: a resize verifies the copy it loads, as a
    resume verifies the checkpoint (``resume.verify_universal_copy``). The merged files were made durable and
    digested by the rank that wrote them (``digested``); the rest are here."""
    names = manifest.checkpoint_files(partial)
    rest = [name for name in names if not digested.get(name)]
    durability.persist_files(partial, rest)
    digests = {**manifest.digests(partial, rest), **{name: digested[name] for name in names if name not in rest}}
    manifest.write_manifest(partial, digests, {"universal_copy_of": source})
    durability.persist_tree_directories(partial)


def _prepare_partial(partial: Path, source: dict[str, str], unsupported: str) -> None:
    """Keep a partial copy of this very checkpoint to resume it; discard any other, saying why."""
    if unsupported:
        _report(f"Universal conversion: not resumable here ({unsupported}); an interrupted one starts over")
    if partial.exists():
        why = _why_not_resumed(partial, source, unsupported)
        if why:
            _report(f"Universal conversion: discarding the partial copy {partial} ({why}); converting from the start")
            shutil.rmtree(partial)
        else:
            _report(f"Universal conversion: resuming the interrupted conversion in {partial}")
    partial.mkdir(parents=True, exist_ok=True)
    temporary = partial / f"{SOURCE_RECORD}.tmp"
    temporary.write_text(json.dumps(source))
    os.replace(temporary, partial / SOURCE_RECORD)


def _why_not_resumed(partial: Path, source: dict[str, str], unsupported: str) -> str:
    recorded = partial / SOURCE_RECORD
    if unsupported:
        return "the installed DeepSpeed's conversion cannot resume"
    try:
        found = json.loads(recorded.read_text())
    except (OSError, ValueError):
        return "it records no source"
    return "" if found == source else "it belongs to another checkpoint or DeepSpeed release"


def _source_of(checkpoint_dir: Path) -> dict[str, str]:
    """What a partial copy must have been converted from to be resumed: the checkpoint's manifest (it holds every
    file's digest), or without one its shard files' names, sizes and times; and the DeepSpeed that converts it."""
    import deepspeed

    manifest = checkpoint_dir / MANIFEST_NAME
    if manifest.is_file():
        identity = manifest.read_bytes()
    else:
        shards = checkpoint_dir / DEEPSPEED_TAG  # what the conversion reads (the copy may be written beside it)
        files = sorted(path for path in shards.rglob("*") if path.is_file())
        listed = [[str(path.relative_to(shards)), path.stat().st_size, path.stat().st_mtime_ns] for path in files]
        identity = json.dumps(listed).encode()
    checkpoint = hashlib.blake2b(identity, digest_size=16).hexdigest()
    return {"checkpoint": checkpoint, "deepspeed": deepspeed.__version__, "records": RECORDS_FORMAT}


def _report(line: str) -> None:
    rank_zero_info(line)  # Lightning's handler, made at import: it writes to stderr even while DeepSpeed's is hidden


def _item_written(files: list[Path]) -> dict[str, Any]:
    """Between a unit of work made durable and its record: the digests of the files it merged, for the manifest
    (module level: it travels to the other ranks with the work)."""
    fault_point(CONVERSION_ITEM_WRITTEN)
    return {str(path): manifest.file_digest(path) for path in files}


# optimizers whose state the universal conversion carries completely (exp_avg and exp_avg_sq, and the step)
CONVERTIBLE_OPTIMIZERS = frozenset({"Adam", "AdamW", "FusedAdam", "DeepSpeedCPUAdam"})


def restore_group_settings(optimizer: Any, groups: Any) -> None:
    """Put each parameter group's recorded settings back (the group count must match: same model, same optimizer)."""
    if not groups or optimizer is None or len(optimizer.param_groups) != len(groups):
        return
    for group, settings in zip(optimizer.param_groups, groups, strict=True):
        for key, value in settings.items():
            if key in group:
                group[key] = tuple(value) if isinstance(group[key], tuple) else value
