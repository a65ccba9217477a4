"""The one save path of the Trainer's and Fabric's strategies: a checkpoint appears at its path only once every rank's
files are complete, durable and checksummed.

DeepSpeed writes ``latest`` from rank 0 whatever the other ranks did, so a rank that dies half-way through its shard
leaves a directory that looks complete. Here, read top to bottom:

1. :func:`committed_save` (what both strategies call) prepares: rank 0 refuses node-local disks (first save only),
   claims the folder for this job, repairs a commit a crash interrupted, and clears what a killed save left in
   ``.hpz-staging/<name>.partial`` beside ``<path>`` (``staging.py``). One broadcast tells every rank it may write.
2. DeepSpeed saves into that staging folder; every file it writes through its checkpoint engine is checksummed and
   made durable by the rank that writes it (``partitioning/hashed_writes.py``). So each rank knows its own files:
   nothing is listed or read back, and no rank touches another rank's shards.
3. :func:`_commit`: each rank sends rank 0 its record (names, sizes, digests, or its failure): one gather of small
   records. Rank 0 writes ``latest``, reads back only the files nobody recorded (``latest`` itself), writes the
   manifest last and moves the folder into place; one broadcast tells every rank the outcome, so a failure on any
   rank is raised on every rank and none is left waiting in a collective.
4. The copy the new one replaced is deleted by a thread of rank 0's, off the critical path; it is joined at the next
   save or load and at teardown (or, in a script that never tears down, at exit).

A crash at any point before the move leaves ``<path>`` untouched: the previous checkpoint stays the newest, and
Lightning (``ModelCheckpoint``'s paths, ``ckpt_path="last"``) never sees the partial one.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

from lightning_hpz import collectives, durability
from lightning_hpz.checkpointing import commit_repair, manifest, writer_lock
from lightning_hpz.checkpointing.atomic_exchange import atomic_exchange
from lightning_hpz.checkpointing.errors import CheckpointStorageError
from lightning_hpz.checkpointing.fault_points import fault_point
from lightning_hpz.checkpointing.rank_agreement import on_rank_zero
from lightning_hpz.checkpointing.shared_folder import check_one_folder_for_all_ranks
from lightning_hpz.checkpointing.staging import remove_path, replaced_path, staging_path
from lightning_hpz.partitioning.hashed_writes import HashedWrites, hashing_writes

log = logging.getLogger(__name__)
_deletion: Optional[_Deletion] = None  # rank 0's deletion of the copy the last commit replaced


@contextmanager
def committed_save(final: Path, run: dict[str, Any], engine: Any = None) -> Iterator[Path]:
    """Yield the staging folder to save into; on exit, write the manifest and move the folder to ``final``.

    Collective. ``run`` is recorded in the manifest (``compatibility.describe_run``). ``engine``: the DeepSpeed engine
    that saves (its files are checksummed as they are written); None when the files are written otherwise, and each
    rank then reads back its own (named ``zero_pp_rank_<rank>_``; rank 0 the others).
    """
    final = Path(final)
    staging = staging_path(final)
    _prepare(final, staging)
    with hashing_writes(engine, staging) as writes:
        yield staging
    _commit(staging, final, run, writes)


def finish_saves() -> None:
    """At teardown: the replaced copy is deleted and the folders this process claimed are free for the next job."""
    wait_for_old_copy_deletion()
    writer_lock.release_all()


def wait_for_old_copy_deletion() -> None:
    """Join the deletion of the copy the last commit replaced (before anything else touches the folder)."""
    global _deletion
    deletion, _deletion = _deletion, None
    if deletion is not None:
        deletion.stop()


def _prepare(final: Path, staging: Path) -> None:
    wait_for_old_copy_deletion()
    if collectives.rank() == 0:
        staging.parent.mkdir(parents=True, exist_ok=True)
    # node-local disks: refused now, not at the resume. The refusal names the folder the user chose (ModelCheckpoint's
    # dirpath), not the hidden staging folder inside it, where the token goes
    check_one_folder_for_all_ranks(final.parent, probe_dir=staging.parent)
    # before anything in the folder is touched: another job's staged copy or interrupted commit is not ours to clear
    writer_lock.claim_for_this_job(final.parent)
    cleared = on_rank_zero(lambda: _clear_staging(final, staging), f"Cannot prepare the save of {final}")
    if not cleared:  # a crash mid-commit must not cost the checkpoint at `final`: repaired first, together
        commit_repair.repair_together([final])
        on_rank_zero(lambda: _clear_staging(final, staging), f"Cannot prepare the save of {final}")


def _clear_staging(final: Path, staging: Path) -> bool:
    """Remove what a killed save left at ``staging``, unless a commit was interrupted (its copy is needed)."""
    if commit_repair.interrupted(final):
        return False
    remove_path(staging)
    return True


def _commit(staging: Path, final: Path, run: dict[str, Any], writes: Optional[HashedWrites]) -> None:
    records = collectives.gather_object(_own_files(staging, writes))
    outcome = None
    if collectives.rank() == 0:
        latest_tag = writes.latest_tag if writes is not None else None
        outcome = _publish(staging, final, run, records, latest_tag)
    outcome = collectives.broadcast_object(outcome)
    if outcome is not None:
        raise CheckpointStorageError(outcome)


def _own_files(staging: Path, writes: Optional[HashedWrites]) -> dict[str, Any]:
    """This rank's record for the manifest: ``{"files": {name: {size, blake2b}}}``, or ``{"error": ...}``."""
    rank = collectives.rank()
    try:
        if writes is not None:
            if writes.failures:
                raise OSError("; ".join(writes.failures))
            return {"files": writes.digests}
        # written by a checkpoint engine that is not wrapped: the writer makes its files durable (its own client holds
        # the dirty pages on a network file system) and reads them back
        names = manifest.files_written_by(staging, rank, collectives.world_size())
        durability.persist_files(staging, names)
        return {"files": manifest.digests(staging, names)}
    except (OSError, ValueError) as failure:
        return {"error": f"rank {rank}: {failure}"}


def _publish(
    staging: Path, final: Path, run: dict[str, Any], records: list[dict[str, Any]], latest_tag: Optional[str]
) -> Optional[str]:
    """Rank 0: the manifest from every rank's record, then the move into place; None, or why the save failed."""
    errors = [record["error"] for record in records if "error" in record]
    if not errors:
        try:
            _write_manifest(staging, run, records, latest_tag)
            _move_into_place(staging, final)
        except (OSError, ValueError) as failure:
            errors = [f"rank 0: {failure}"]
    if not errors:
        return None
    return (
        f"Saving checkpoint {final} failed ({'; '.join(errors)}). The save is abandoned; the checkpoint that was at "
        f"{final} before it is kept. Fix the cause (free space, the storage) and save again."
    )


def _write_manifest(
    staging: Path, run: dict[str, Any], records: list[dict[str, Any]], latest_tag: Optional[str]
) -> None:
    files = {name: entry for record in records for name, entry in record["files"].items()}
    if latest_tag is not None:
        (staging / manifest.LATEST_NAME).write_text(latest_tag)
    # listed once, by rank 0: the files no rank recorded (`latest`, a file written around the engine) are read back
    unrecorded = [name for name in manifest.checkpoint_files(staging) if name not in files]
    durability.persist_files(staging, unrecorded)
    files.update(manifest.digests(staging, unrecorded))
    manifest.write_manifest(staging, files, run)
    durability.persist_tree_directories(staging)  # every file's directory entry, the manifest's last


def _move_into_place(staging: Path, final: Path) -> None:
    """Put the complete staged copy at ``final``; at every instant of this, ``final`` or a repairable state exists.

    Overwriting (``last.ckpt``): where the file system can swap two paths atomically (Linux ``renameat2`` with
    ``RENAME_EXCHANGE``: ext4, xfs, btrfs, tmpfs), the new copy and the old one swap places; ``final`` always holds a
    complete checkpoint. Elsewhere the old copy moves aside first; a crash before the new one is in place is repaired
    at the next save or start (``commit_repair.py``). Whatever was at ``final`` (a checkpoint, a file or link another
    strategy saved) is then deleted in the background.
    """
    fault_point("commit:manifest_written")
    if not os.path.lexists(final):
        staging.rename(final)
        _persist_new_copy(final, staging)
        fault_point("commit:new_in_place")
        with contextlib.suppress(OSError):  # still holding another save's files
            staging.parent.rmdir()
        return
    if atomic_exchange(staging, final):
        _persist_new_copy(final, staging)  # the new copy is durably in place before the old one goes
        fault_point("commit:new_in_place")
        _delete_in_background(staging)
        return
    replaced = replaced_path(final)
    remove_path(replaced)
    final.rename(replaced)
    _persist_entries(final, staging)  # the move aside is on the storage before the staged copy takes the path
    fault_point("commit:old_moved_aside")
    staging.rename(final)
    _persist_new_copy(final, staging)
    fault_point("commit:new_in_place")
    _delete_in_background(replaced)


def _persist_entries(final: Path, staging: Path) -> None:
    durability.persist_directory(final.parent)
    durability.persist_directory(staging.parent)


def _persist_new_copy(final: Path, staging: Path) -> None:
    # the new copy is at `final` already: a failure now must not be reported as a save abandoned
    try:
        _persist_entries(final, staging)
    except OSError as error:
        log.warning("Checkpoint %s is in place, but its directory entry may not be durable yet: %s", final, error)


def _delete_in_background(old_copy: Path) -> None:
    # Deleting a large checkpoint (thousands of files on a parallel file system) would hold every rank in the save.
    # A crash meanwhile leaves part of it in the staging folder: the next save clears it, the repair ignores it.
    global _deletion

    def delete() -> None:
        try:
            remove_path(old_copy)
        except OSError as error:
            log.warning("Could not delete the replaced checkpoint %s (%s); the next save retries.", old_copy, error)
        with contextlib.suppress(OSError):  # still holding another save's files
            old_copy.parent.rmdir()

    _deletion = _Deletion(delete)
    _deletion.start()


class _Deletion(threading.Thread):
    """A daemon with ``stop()`` (finish the deletion), the contract by which Lightning's own test harness ends a thread
    a Fabric script left running; joined at exit, so a script's last save still deletes what it replaced."""

    def __init__(self, delete: Callable[[], None]) -> None:
        super().__init__(target=delete, name="lightning-hpz-replaced-copy-deletion", daemon=True)
        atexit.register(self.stop)

    def stop(self) -> None:
        atexit.unregister(self.stop)
        if self is not threading.current_thread():
            self.join()
