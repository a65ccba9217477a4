"""Finish or undo the commits a crash interrupted, before anything reads the checkpoint.

A commit on a file system without an atomic exchange renames twice (``commit.py``); killed in between, the
checkpoint's own path is missing and its two copies wait in the staging folder. Whoever loads next repairs first
(``commit_repair.py``): a resume by name the run's folders (``resume_by_name.py``), an explicit ``ckpt_path`` its own
path. Collective: the ranks verify the staged copy together, rank 0 renames. Nothing is touched while another job
holds the folder's writer lock: its commit may still be under way.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lightning_hpz import collectives
from lightning_hpz.checkpointing import commit_repair, writer_lock
from lightning_hpz.checkpointing.rank_agreement import on_rank_zero

log = logging.getLogger(__name__)


def repair_folders(folders: list[Path]) -> None:
    """Collective: repair every interrupted commit in rank 0's ``folders`` (the other ranks' are ignored)."""

    def interrupted() -> list[Path]:
        finals: list[Path] = []
        for folder in folders:
            if not _another_job_writes(folder):
                finals += commit_repair.interrupted_commits_in(folder)
        return finals

    finals = on_rank_zero(interrupted, f"Cannot look for interrupted commits in {folders}")
    commit_repair.repair_together(finals)


def repair_before_load(checkpoint_path: Any) -> None:
    """Collective: repair an interrupted commit of ``checkpoint_path`` (a local path) before it is read."""
    path = Path(checkpoint_path)
    wanted = collectives.rank() == 0 and "://" not in str(checkpoint_path)
    # whether it was interrupted is repair_together's to find (an error there reaches every rank)
    commit_repair.repair_together([path] if wanted and not _another_job_writes(path.parent) else [])


def _another_job_writes(folder: Path) -> bool:
    try:
        holder = writer_lock.held_by_another_job(folder)
    except OSError:  # the folder cannot be read: repair_together reports it on every rank
        return False
    if holder is not None:
        log.warning("Not repairing interrupted commits in %s: job %s may still be writing it.", folder, holder)
    return holder is not None
