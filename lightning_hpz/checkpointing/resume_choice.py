"""Which checkpoint a resume by name (``ckpt_path="hpc"``, ``"last"``, SLURM's auto-resume) takes: the newest committed.

Lightning chooses by name: ``"hpc"`` (and SLURM's auto-resume) the largest N of ``hpc_ckpt_<N>`` in
``default_root_dir``, ``"last"`` the most recently modified ``last*.ckpt``. A job requeued after a preemption then
saves ``last.ckpt`` at higher steps while ``hpc_ckpt_1`` stays, and the next auto-resume went back to the preemption's
step. Here every checkpoint this package committed in the run's folders competes by the global step its manifest
records (written when the commit completed); Lightning's choice stands when none is newer.

Pure file-system reads: no process group, no torch. The caller (``resume_by_name.py``) runs it on rank 0 after the
interrupted commits in those folders are repaired, and broadcasts the outcome.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from lightning_hpz.checkpointing import manifest

CHECKPOINT_SUFFIX = ".ckpt"


@dataclass(frozen=True)
class CommittedCheckpoint:
    path: Path
    step: int
    committed_at: float  # when its manifest was written (the commit's last write before the rename)


def committed_checkpoints(folders: Iterable[Path]) -> list[CommittedCheckpoint]:
    """The checkpoints committed by this package in ``folders``: ``*.ckpt`` directories whose manifest is there and
    records a global step. Only the manifests are read: whether a candidate's files are all there is asked of the one
    :func:`choose` picks (at 2,049 files a checkpoint, statting every kept one would cost the start minutes)."""
    found = []
    for folder in folders:
        if not Path(folder).is_dir():
            continue
        for entry in sorted(Path(folder).iterdir()):
            if entry.name.startswith(".") or entry.suffix != CHECKPOINT_SUFFIX or not entry.is_dir():
                continue  # the hidden staging folder holds uncommitted copies
            step = ((manifest.read_manifest(entry) or {}).get("run") or {}).get("global_step")
            if step is not None:
                found.append(CommittedCheckpoint(entry, int(step), (entry / manifest.MANIFEST_NAME).stat().st_mtime))
    return found


def choose(lightning_choice: Optional[Path], committed: list[CommittedCheckpoint]) -> Optional[Path]:
    """The checkpoint to resume: the committed one with the highest global step.

    At equal steps Lightning's own choice wins (a tie changes nothing), then the one committed last, then the name
    (so the outcome never depends on the order of a directory listing). With nothing committed, Lightning's choice
    stands: checkpoints without a manifest (not written by this package) have no step to compare. Lightning's choice
    is returned as given (not resolved) when it wins.
    """
    if not committed:
        return lightning_choice
    chosen_by_lightning = _resolved(lightning_choice)

    def rank(candidate: CommittedCheckpoint) -> tuple:
        is_lightnings = chosen_by_lightning is not None and _resolved(candidate.path) == chosen_by_lightning
        return candidate.step, is_lightnings, candidate.committed_at, str(candidate.path)

    best = max(committed, key=rank)
    return lightning_choice if rank(best)[1] else best.path


def choose_complete(lightning_choice: Optional[Path], committed: list[CommittedCheckpoint]) -> Optional[Path]:
    """:func:`choose` among the candidates whose files all have their recorded sizes (a full checksum is the load's):
    only the candidates chosen are statted, the newest first."""
    left = list(committed)
    while True:
        chosen = choose(lightning_choice, left)
        candidate = next((c for c in left if _resolved(c.path) == _resolved(chosen)), None)
        if candidate is None or manifest.complete_manifest(candidate.path) is not None:
            return chosen
        left.remove(candidate)


def step_of(path: Optional[Path], committed: list[CommittedCheckpoint]) -> Optional[int]:
    """The global step of ``path`` among ``committed``; None when it is not one of them."""
    target = _resolved(path)
    return next((c.step for c in committed if _resolved(c.path) == target), None) if target else None


def _resolved(path: Optional[Path]) -> Optional[Path]:
    return Path(path).resolve() if path is not None else None
