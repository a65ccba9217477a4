"""Finish or undo a checkpoint commit that a crash interrupted between its two renames (``commit.py``).

Killed after the old copy moved aside and before the staged copy moved in, a checkpoint's path is missing and both
copies wait in the staging folder. The repair rolls forward only when the staged copy verifies against its manifest
by checksum, not by size alone: rolling forward deletes the old copy, so a staged shard of the right size but wrong
bytes would cost both. The checksums are shared by the ranks, balanced by bytes (:func:`staged_copy_verifies`), so no
rank hashes a large checkpoint alone while the others wait in a timed collective.

Whoever loads next repairs first: a resume by name the run's folders (:func:`repair_folders`), an explicit
``ckpt_path`` its own path (:func:`repair_before_load`), and the next save of that name (``commit.py``). Nothing is
touched while another job holds the folder's writer lock: its commit may still be under way.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Optional

from lightning_hpz import collectives, durability
from lightning_hpz.checkpointing import manifest, writer_lock
from lightning_hpz.checkpointing.rank_agreement import manifest_shares, on_rank_zero, problems_found_together
from lightning_hpz.checkpointing.staging import (
    REPLACED_SUFFIX,
    STAGING_FOLDER,
    remove_path,
    replaced_path,
    staging_path,
)

log = logging.getLogger(__name__)


def interrupted(final: Path) -> bool:
    """A commit of ``final`` stopped with a copy moved aside (or a finished one not yet cleaned up)."""
    return os.path.lexists(replaced_path(Path(final)))


def repair_interrupted_commit(final: Path, staged_verifies: Optional[bool] = None) -> str:
    """Finish or undo an interrupted commit of ``final`` (one process); what was done, "" when nothing was needed.

    ``staged_verifies``: whether the staged copy matched its manifest, as the ranks found together; None checks it
    here, every file by checksum.
    """
    final, staging, replaced = Path(final), staging_path(Path(final)), replaced_path(Path(final))
    if os.path.lexists(final):
        if os.path.lexists(replaced):  # the new copy made it; the old one was not deleted yet
            remove_path(replaced)
            return "deleted the copy a finished commit had moved aside"
        return ""
    if not os.path.lexists(replaced):
        return ""
    if staged_verifies is None:
        recorded = manifest.complete_manifest(staging)
        staged_verifies = bool(recorded) and not manifest.verify_files(staging, recorded, list(recorded["files"]))
    if staged_verifies:
        staging.rename(final)
        what = "rolled forward to the staged copy, which verified against its manifest"
    else:
        replaced.rename(final)
        what = "rolled back to the previous copy (the staged one was incomplete or did not verify)"
    durability.persist_directory(final.parent)  # the repair survives a power loss before the old copy goes
    durability.persist_directory(staging.parent)
    if os.path.lexists(replaced):
        remove_path(replaced)
    return what


def interrupted_commits_in(folder: Path) -> list[Path]:
    """The checkpoint paths in ``folder`` whose commit a crash left with a copy moved aside."""
    staging = Path(folder) / STAGING_FOLDER
    if not staging.is_dir():
        return []
    return [Path(folder) / p.name[: -len(REPLACED_SUFFIX)] for p in sorted(staging.glob("*" + REPLACED_SUFFIX))]


def staged_copy_verifies(staging: Path) -> bool:
    """Collective: whether the staged copy at ``staging`` is complete and every file matches its manifest; each rank
    checksums an equal share of the bytes, sent by rank 0 (the one rank that reads the manifest)."""
    share = manifest_shares(staging, read=_complete_manifest)
    return share is not None and not problems_found_together(staging, share)


def _complete_manifest(staging: Path) -> Optional[dict[str, Any]]:
    try:
        return manifest.complete_manifest(staging)
    except (OSError, ValueError):  # unreadable (a manifest cut short): not a copy to roll forward to
        return None


def repair_together(finals: list[Path]) -> dict[Path, str]:
    """Collective: repair the interrupted commits among rank 0's ``finals`` (the other ranks' are ignored); what was
    done, by path. A failure on rank 0 is raised on every rank."""
    looked_for = f"Cannot look for interrupted commits of {[str(f) for f in finals]}"
    plan = on_rank_zero(lambda: [str(final) for final in finals if interrupted(Path(final))], looked_for)
    done: dict[Path, str] = {}
    for final in map(Path, plan):
        verifies = staged_copy_verifies(staging_path(final))
        what = on_rank_zero(
            lambda final=final, verifies=verifies: repair_interrupted_commit(final, verifies),
            f"Cannot repair the interrupted commit of {final}",
        )
        if what:
            log.warning("Checkpoint %s: its save was interrupted while committing; %s.", final, what)
            done[final] = what
    return done


def repair_folders(folders: list[Path]) -> None:
    """Collective: repair every interrupted commit in rank 0's ``folders`` (the other ranks' are ignored)."""

    def interrupted_here() -> list[Path]:
        finals: list[Path] = []
        for folder in folders:
            if not _another_job_writes(folder):
                finals += interrupted_commits_in(folder)
        return finals

    finals = on_rank_zero(interrupted_here, f"Cannot look for interrupted commits in {folders}")
    repair_together(finals)


def repair_before_load(checkpoint_path: Any) -> None:
    """Collective: repair an interrupted commit of ``checkpoint_path`` (a local path) before it is read."""
    path = Path(checkpoint_path)
    wanted = collectives.rank() == 0 and "://" not in str(checkpoint_path)
    # whether it was interrupted is repair_together's to find (an error there reaches every rank)
    repair_together([path] if wanted and not _another_job_writes(path.parent) else [])


def _another_job_writes(folder: Path) -> bool:
    try:
        holder = writer_lock.held_by_another_job(folder)
    except OSError:  # the folder cannot be read: repair_together reports it on every rank
        return False
    if holder is not None:
        log.warning("Not repairing interrupted commits in %s: job %s may still be writing it.", folder, holder)
    return holder is not None
