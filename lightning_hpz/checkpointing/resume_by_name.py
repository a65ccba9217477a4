"""``ckpt_path="hpc"``, ``"last"`` and SLURM's auto-resume, chosen once every rank has started: repair, then the newest.

Lightning resolves these names in ``Trainer.fit`` (and ``validate``/``test``/``predict``) before the strategy sets
anything up, on each rank by itself (the Trainer's checkpoint connector, a Lightning internal reached through
:mod:`lightning_hpz.lightning_internals`). Two things cannot be done there. A commit that a crash
left between its two renames (file systems without an atomic exchange) leaves no ``last.ckpt`` until it is repaired,
and one process must repair it while the others wait, which needs the process group. And the choice among the run's
checkpoints (``resume_choice.py``) must be the same on every rank.

So, while an entry point runs, the Trainer's connector is a :class:`ResumeByNameConnector` (the strategy's launcher
makes it one and back, :func:`connector_installed`). It leaves every other ``ckpt_path`` to Lightning; for
these names it returns a :class:`ResumeByName` placeholder, which the strategy resolves as soon as the process group
exists (:func:`choose`): rank 0 repairs the run's folders, asks Lightning's own resolution, takes the newest committed
checkpoint, and every rank receives that path. ``resume_start`` then loads it.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Optional

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_hpz import lightning_internals
from lightning_hpz.checkpointing import commit_repair, resume_choice
from lightning_hpz.checkpointing.rank_agreement import on_rank_zero


class ResumeByName:
    """A ``ckpt_path`` given by name, until every rank has started; then ``path`` holds the choice (None: none)."""

    def __init__(self, name: str, lightning_choice: Callable[[], Optional[Any]]) -> None:
        self.name = name
        self.lightning_choice = lightning_choice  # Lightning's own resolution of the name, run by rank 0 at the choice
        self.chosen = False
        self.path: Optional[str] = None

    def __repr__(self) -> str:
        return repr(self.path) if self.chosen else f"ckpt_path={self.name!r} (chosen once every rank has started)"

    __str__ = __repr__


class ResumeByNameConnector(lightning_internals.ExtensibleCheckpointConnector):
    """Lightning's connector, with ``"hpc"``, ``"last"`` and SLURM's auto-resume chosen by :func:`choose`."""

    by_name: Optional[ResumeByName] = None

    @override
    def select_ckpt_path(self, state_fn: Any, ckpt_path: Any, model_provided: bool, model_connected: bool) -> Any:
        self.by_name = None  # a placeholder belongs to one entry point
        return super().select_ckpt_path(state_fn, ckpt_path, model_provided, model_connected)

    @override
    def parse_ckpt_path(self, state_fn: Any, ckpt_path: Any, model_provided: bool, model_connected: bool) -> Any:
        name = self._resume_name(ckpt_path)
        if name is None:
            return super().parse_ckpt_path(state_fn, ckpt_path, model_provided, model_connected)
        lightning = functools.partial(super().parse_ckpt_path, state_fn, name, model_provided, model_connected)
        self.by_name = ResumeByName(name, lightning)
        return self.by_name

    def _resume_name(self, ckpt_path: Any) -> Optional[str]:
        if ckpt_path == "last":
            return "last"
        # Lightning's own trigger of SLURM's auto-resume (an hpc_ckpt_<N> is there), and its ValueError for "hpc"
        # without one, are kept: only which checkpoint is resumed changes
        wants_hpc = ckpt_path == "hpc" or (ckpt_path is None and SLURMEnvironment.detect())
        return "hpc" if wants_hpc and self.hpc_resume_path is not None else None

    @override
    def resolve_checkpoint_path(self, checkpoint_path: Any) -> Any:
        if isinstance(checkpoint_path, ResumeByName):
            choose(self.trainer)  # done when the process group was set up; here only if a strategy skipped it
            return checkpoint_path.path
        return checkpoint_path


def connector_installed(trainer: Any) -> AbstractContextManager[None]:
    """Make ``trainer``'s checkpoint connector a :class:`ResumeByNameConnector` while an entry point runs."""
    return lightning_internals.checkpoint_connector_extended(trainer, ResumeByNameConnector)


def chosen_path(ckpt_path: Any) -> Any:
    """``ckpt_path`` with a resolved :class:`ResumeByName` replaced by its path (for code that reads the argument)."""
    return ckpt_path.path if isinstance(ckpt_path, ResumeByName) else ckpt_path


def choose(trainer: Any) -> None:
    """Collective: resolve the entry point's resume by name, if any; every rank gets rank 0's choice."""
    by_name = getattr(lightning_internals.checkpoint_connector(trainer), "by_name", None)
    if by_name is None or by_name.chosen:
        return
    failure, errors = f"Cannot choose the checkpoint for ckpt_path={by_name.name!r}", (OSError, ValueError)
    folders = on_rank_zero(lambda: run_folders(trainer), failure, errors)
    # the ranks repair together (each verifies a share of a staged copy), then rank 0 chooses
    commit_repair.repair_folders(folders)
    by_name.path = on_rank_zero(lambda: _choose_on_rank_zero(by_name, folders), failure, errors)
    by_name.chosen = True


def run_folders(trainer: Any) -> list[Path]:
    """Where the run's checkpoints are: ``default_root_dir`` (preemption checkpoints), each ``ModelCheckpoint``'s
    folder, ``OnExceptionCheckpoint``'s; local paths only, each once."""
    places = [trainer.default_root_dir]
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            # the folder as Lightning's own "last" lookup finds it (dirpath, or from the logger or default_root_dir)
            places.append(lightning_internals.resolve_ckpt_dir(callback, trainer))
    places += [callback.dirpath for callback in trainer.callbacks if isinstance(callback, OnExceptionCheckpoint)]
    folders: list[Path] = []
    for place in places:
        if place is None or "://" in str(place):  # a remote file system: not committed by this package
            continue
        if Path(place).resolve() not in [folder.resolve() for folder in folders]:
            folders.append(Path(place))
    return folders


def _choose_on_rank_zero(by_name: ResumeByName, folders: list[Path]) -> Optional[str]:
    with warnings.catch_warnings(record=True) as held:  # "no last checkpoint" would be wrong if we find one
        warnings.simplefilter("always")
        lightning_choice = by_name.lightning_choice()
    committed = resume_choice.committed_checkpoints(folders)
    chosen = resume_choice.choose_complete(Path(lightning_choice) if lightning_choice else None, committed)
    if chosen is None or str(chosen) == str(lightning_choice):
        for caught in held:
            warnings.warn_explicit(caught.message, caught.category, caught.filename, caught.lineno)
        return lightning_choice and str(lightning_choice)
    step, replaced_step = resume_choice.step_of(chosen, committed), resume_choice.step_of(lightning_choice, committed)
    by_lightning = f"{lightning_choice} (step {replaced_step})" if lightning_choice else "nothing"
    rank_zero_info(
        f"ckpt_path={by_name.name!r}: resuming from {chosen}, the newest committed checkpoint (step {step}) in "
        f"{', '.join(str(folder) for folder in folders)}; Lightning's choice by name was {by_lightning}."
    )
    return str(chosen)
