"""Finish or undo the commits a crash interrupted, before anything reads the checkpoint.

A commit on a file system without an atomic exchange renames twice (``commit.py``); killed in between, the
checkpoint's own path is missing and its two copies wait in the staging folder. Whoever loads next repairs first: a
resume by name repairs the run's folders (``resume_by_name.py``), an explicit ``ckpt_path`` its own path
(:func:`repair_before_load`). One process (rank 0) repairs while the others wait, and nothing is touched while
another job holds the folder's writer lock: its commit may still be under way.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lightning_hpz import collectives
from lightning_hpz.checkpointing import commit, writer_lock
from lightning_hpz.checkpointing.errors import CheckpointStorageError

log = logging.getLogger(__name__)


def repair_folder(folder: Path) -> None:
    """Repair every interrupted commit in ``folder`` (rank 0 alone)."""
    if _another_job_writes(folder):
        return
    for final, what in commit.repair_interrupted_commits_in(folder).items():
        log.warning("Checkpoint %s: the previous save was interrupted while committing; %s.", final, what)


def repair_before_load(checkpoint_path: Any) -> None:
    """Collective: rank 0 repairs an interrupted commit of ``checkpoint_path``; a failure is raised on every rank."""
    path = Path(checkpoint_path)
    outcome: dict[str, str] = {}
    if collectives.rank() == 0 and "://" not in str(checkpoint_path) and _interrupted(path):
        try:
            outcome = {"done": "" if _another_job_writes(path.parent) else commit.repair_interrupted_commit(path)}
        except OSError as error:  # raised on rank 0 alone, the other ranks would wait in the broadcast
            outcome = {"error": f"Cannot repair the interrupted commit of {path} before loading it: {error}"}
    outcome = collectives.broadcast_object(outcome)
    if "error" in outcome:
        raise CheckpointStorageError(outcome["error"])
    if outcome.get("done"):
        log.warning("Checkpoint %s: its save was interrupted while committing; %s.", path, outcome["done"])


def _interrupted(path: Path) -> bool:
    return commit.replaced_path(path).exists()


def _another_job_writes(folder: Path) -> bool:
    holder = writer_lock.held_by_another_job(folder)
    if holder is not None:
        log.warning("Not repairing interrupted commits in %s: job %s may still be writing it.", folder, holder)
    return holder is not None
