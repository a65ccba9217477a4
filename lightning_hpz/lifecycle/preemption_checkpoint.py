"""``PreemptionCheckpoint``: on SIGTERM/SIGUSR1, commit a checkpoint and exit 75, or exit 143 with nothing to save."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any, Optional

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_hpz import collectives, lightning_internals
from lightning_hpz.lifecycle.run_exit import (
    DEFAULT_SIGNALS,
    PREEMPTED_EXIT_CODE,
    PREEMPTED_NOTHING_SAVED_EXIT_CODE,
    PreemptedWithoutCheckpoint,
    PreemptionSignals,
    TrainingPreempted,
)

_HPC_CHECKPOINT = re.compile(r"^hpc_ckpt_(\d+)\.ckpt$")


class PreemptionCheckpoint(Callback):
    """Turn a preemption signal into a committed checkpoint and exit code 75, or, with nothing to save, exit 143.

    The signal handler only records the signal. The ranks agree on it with ordinary all-reduces of that flag, on the
    default process group (no side group: a world-wide one would be a full mesh of connections), at points every rank
    reaches in the same order:

    - after every optimizer step: each rank starts the reduction and reads the one it started a step earlier
      (:class:`~lightning_hpz.collectives.PendingReduction`), so no step waits for the GPU;
    - at the start of training and of every evaluation loop (``validate``, ``test``, ``predict``, the sanity check,
      validation inside ``fit``): once, after the checkpoint was loaded and the state restored;
    - after every evaluation batch, pipelined the same way, and once more when the loop ends.

    When any rank was signalled and this run has trained since it started (or resumed), all ranks save
    ``<default_root_dir>/hpc_ckpt_<N>.ckpt`` and the run ends with :class:`~lightning_hpz.lifecycle.run_exit.
    TrainingPreempted` (a ``SystemExit`` with code 75, ``PREEMPTED_EXIT_CODE``). When it has not (the signal came
    during set-up, the checkpoint load, the sanity check, before the first step, or in ``validate``/``test``/
    ``predict``), nothing is saved and the run ends with :class:`~lightning_hpz.lifecycle.run_exit.
    PreemptedWithoutCheckpoint` (code 143, ``PREEMPTED_NOTHING_SAVED_EXIT_CODE``). Lightning resumes from the newest
    ``hpc_ckpt_<N>`` by itself under SLURM, and with ``fit(ckpt_path="hpc")`` anywhere else. Under SLURM with
    ``SLURMEnvironment(auto_requeue=True)`` (Lightning's default there) rank 0 also requeues the job, for either code.

    ``HpzStrategy`` adds this callback unless told not to (``handle_preemption=False``) and holds its handler from
    strategy set-up to teardown (:meth:`open_window`), Lightning's own handler never installed. With another strategy
    the callback installs its handler at the start of each loop and removes it at the loop's end; before that,
    Lightning's handler is the one in place.

    A new preemption checkpoint retires the older ones (renamed ``preempted-step=<S>.ckpt``, outside Lightning's
    ``hpc_ckpt_<N>`` numbering) and keeps the newest ``keep`` of those. Under ``HpzStrategy`` a resume by name takes
    the newest committed checkpoint of the run, a ``last.ckpt`` saved after the preemption included.

    Args:
        signals: the signal names that mean "preempted". Default SIGTERM and SIGUSR1.
        keep: retired preemption checkpoints kept, the newest first. Default 1.
    """

    def __init__(self, signals: tuple[str, ...] = DEFAULT_SIGNALS, keep: int = 1) -> None:
        self.preemption = PreemptionSignals(tuple(signals))
        self.keep = keep
        self._step_at_batch_start = -1
        self._step_at_train_start: Optional[int] = None  # None: this run has not started training
        self.checkpoint: Optional[str] = None
        self._agreement: Optional[collectives.PendingReduction] = None  # the flags of the previous optimizer step
        self._evaluation_agreement: Optional[collectives.PendingReduction] = None  # of the previous evaluation batch
        self._window: Optional[Trainer] = None  # the Trainer whose run holds the handler (open_window)

    # ------------------------------------------------------------------------------------------------ the window
    def open_window(self, trainer: Trainer) -> None:
        """Record the signals from now until :meth:`close_window`, instead of Lightning's handler (strategy set-up).

        Lightning's ``_SignalConnector.register_signal_handlers`` runs in ``Trainer._run`` after the checkpoint was
        restored and would put its own handler first (a broadcast inside the handler, then ``SIGTERMException``:
        exit 0 with nothing saved). For this run it is made to register nothing; ``close_window`` undoes that.
        """
        self.preemption.install()
        self._step_at_train_start = None
        self._window = trainer
        lightning_internals.skip_lightning_signal_handlers(trainer)

    def close_window(self) -> None:
        """Restore the handlers that were in place before :meth:`open_window` (strategy teardown)."""
        trainer, self._window = self._window, None
        if trainer is not None:
            lightning_internals.allow_lightning_signal_handlers(trainer)
        self.preemption.uninstall()
        self._agreement = self._evaluation_agreement = None

    # ------------------------------------------------------------------------------------------------ training
    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Without the strategy's window, Lightning registered its own SIGTERM handler just before; replace it here.
        self.preemption.install()
        self._agreement = None
        self._step_at_train_start = trainer.global_step
        self._agree_now(trainer)  # a signal during the checkpoint load or the restore: nothing trained yet

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_at_batch_start = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._step_at_batch_start:
            return  # inside a gradient-accumulation window: a checkpoint here would lose the accumulated gradients
        previous, self._agreement = self._agreement, self._start_agreement()
        signalled = previous is not None and previous.result()[0]
        if signalled and trainer.global_step < (trainer.max_steps if trainer.max_steps >= 0 else float("inf")):
            self._preempt(trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._window is None:
            self.preemption.uninstall()
        if self._agreement is not None:  # every rank started it: finish it so no collective is left in flight
            self._agreement.result()
            self._agreement = None

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self._window is None:
            self.preemption.uninstall()

    # ------------------------------------------------------------------------------------------------ evaluation
    # Every evaluation loop (the sanity check and validation inside fit included) agrees once when it starts and
    # then after every batch. A batch-end reduction is started at batch k and read at batch k+1, like the training
    # one: it overlaps the next batch, so an evaluation batch does not wait on it (a
    # synchronous all-reduce per batch would add one network round trip to every batch). The decision lands one
    # batch after the signal, at the same batch on every rank; the loop's end reads the last one.
    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start_evaluation(trainer)

    @override
    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start_evaluation(trainer)

    @override
    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start_evaluation(trainer)

    @override
    def on_validation_batch_end(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None:
        self._after_evaluation_batch(trainer)

    @override
    def on_test_batch_end(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None:
        self._after_evaluation_batch(trainer)

    @override
    def on_predict_batch_end(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None:
        self._after_evaluation_batch(trainer)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._end_evaluation(trainer)

    @override
    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._end_evaluation(trainer)

    @override
    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._end_evaluation(trainer)

    def _start_evaluation(self, trainer: Trainer) -> None:
        self.preemption.install()  # without the strategy's window (another strategy): from here to the loop's end
        self._evaluation_agreement = None
        self._agree_now(trainer)

    def _after_evaluation_batch(self, trainer: Trainer) -> None:
        previous, self._evaluation_agreement = self._evaluation_agreement, self._start_agreement()
        if previous is not None and previous.result()[0]:
            self._evaluation_agreement.result()  # finish the one just started on every rank before leaving
            self._evaluation_agreement = None
            self._stop(trainer)

    def _end_evaluation(self, trainer: Trainer) -> None:
        pending, self._evaluation_agreement = self._evaluation_agreement, None
        if pending is not None and pending.result()[0]:
            self._stop(trainer)
        if self._window is None and trainer.state.fn != TrainerFn.FITTING:
            self.preemption.uninstall()

    # ------------------------------------------------------------------------------------------------ decisions
    def _start_agreement(self) -> collectives.PendingReduction:
        return collectives.PendingReduction([float(self.preemption.received is not None)], op="max")

    def _agree_now(self, trainer: Trainer) -> None:
        if self._start_agreement().result()[0]:
            self._stop(trainer)

    def _stop(self, trainer: Trainer) -> None:
        """Every rank, together: commit a checkpoint if this run trained since it started, else end without one."""
        trained = self._step_at_train_start is not None and trainer.global_step > self._step_at_train_start
        if trained and not trainer.sanity_checking and trainer.state.fn == TrainerFn.FITTING:
            self._preempt(trainer)
        signal_name = self.preemption.name or "a signal on another rank"
        stage = trainer.state.stage.value if trainer.state.stage is not None else "set-up"
        where = "the sanity check" if trainer.sanity_checking else f"{trainer.state.fn.value} ({stage})"
        message = (
            f"Preempted by {signal_name} during {where} at step {trainer.global_step}, before this run trained "
            f"anything to save: no checkpoint committed. Exit code {PREEMPTED_NOTHING_SAVED_EXIT_CODE}; run the same "
            "command again (a resume starts where this run did)."
        )
        rank_zero_info(message)
        if trainer.is_global_zero:
            _requeue_if_slurm(trainer)
        raise PreemptedWithoutCheckpoint(message, trainer)

    def _preempt(self, trainer: Trainer) -> None:
        path = collectives.broadcast_object(next_preemption_checkpoint(trainer.default_root_dir))
        trainer.save_checkpoint(path)  # every rank: a collective under sharded strategies
        self.checkpoint = path
        signal_name = self.preemption.name or "a signal on another rank"
        message = (
            f"Preempted by {signal_name} at step {trainer.global_step}: checkpoint committed at {path}. "
            f"Exit code {PREEMPTED_EXIT_CODE} (resumable); resume with `fit(..., ckpt_path={path!r})` or "
            "ckpt_path='hpc' (automatic under SLURM)."
        )
        rank_zero_info(message)
        if trainer.is_global_zero:
            _requeue_if_slurm(trainer)
        raise TrainingPreempted(message, trainer, path)


def next_preemption_checkpoint(root_dir: str | os.PathLike) -> str:
    """``<root_dir>/hpc_ckpt_<N+1>.ckpt``: the name Lightning's SLURM auto-resume looks for (``ckpt_path='hpc'``)."""
    root = Path(root_dir)
    names = [path.name for path in root.iterdir()] if root.is_dir() else []
    numbers = [int(match.group(1)) for name in names if (match := _HPC_CHECKPOINT.match(name))]
    return str(root / f"hpc_ckpt_{max(numbers, default=0) + 1}.ckpt")


def _requeue_if_slurm(trainer: Trainer) -> None:
    environment = trainer.strategy.cluster_environment
    if not (isinstance(environment, SLURMEnvironment) and environment.auto_requeue):
        return
    job_id = os.environ.get("SLURM_JOB_ID", "")
    if os.environ.get("SLURM_ARRAY_JOB_ID"):
        job_id = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    if not re.fullmatch(r"[0-9_]+", job_id):
        rank_zero_warn(f"Not requeueing: SLURM job id {job_id!r} is not a job id.")
        return
    try:
        result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        rank_zero_warn(f"Not requeueing SLURM job {job_id}: `scontrol` is not on PATH.")
        return
    if result.returncode:
        rank_zero_warn(f"`scontrol requeue {job_id}` failed ({result.returncode}): {result.stderr.strip()}")
    else:
        rank_zero_info(f"Requeued SLURM job {job_id}.")
