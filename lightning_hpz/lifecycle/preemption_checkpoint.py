"""``PreemptionCheckpoint``: on SIGTERM/SIGUSR1, commit a checkpoint at the next optimizer step and exit resumable."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any, Optional

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_hpz import collectives
from lightning_hpz.lifecycle.run_exit import DEFAULT_SIGNALS, PREEMPTED_EXIT_CODE, PreemptionSignals, TrainingPreempted

_HPC_CHECKPOINT = re.compile(r"^hpc_ckpt_(\d+)\.ckpt$")


class PreemptionCheckpoint(Callback):
    """Turn a preemption signal into a committed checkpoint and exit code 75 (``PREEMPTED_EXIT_CODE``).

    The signal handler only records the signal. After every optimizer step each rank starts an all-reduce of its
    flag on a host-side gloo group and reads the one it started a step earlier (:class:`~lightning_hpz.collectives.
    PendingReduction`): no step waits for the GPU, and every rank decides at the same step. When any rank was
    signalled, all save ``<default_root_dir>/hpc_ckpt_<N>.ckpt`` one optimizer step after the signal, and the run
    ends with :class:`~lightning_hpz.preemption.TrainingPreempted` (a ``SystemExit`` with code 75). Lightning resumes
    from the newest such checkpoint by itself under SLURM, and with ``fit(ckpt_path="hpc")`` anywhere else. Under
    SLURM with ``SLURMEnvironment(auto_requeue=True)`` (Lightning's default there) rank 0 also requeues the job.

    ``HpzStrategy`` adds this callback unless told not to (``handle_preemption=False``); it works with any strategy.

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
        self.checkpoint: Optional[str] = None
        self._agreement: Optional[collectives.PendingReduction] = None  # the flags of the previous optimizer step

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning registers its own SIGTERM handler just before the training stage starts; replace it here.
        self.preemption.install()
        self._agreement = None
        if collectives.is_distributed():
            collectives.control_group()  # built now, on every rank, before the first step's collectives

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_at_batch_start = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._step_at_batch_start:
            return  # inside a gradient-accumulation window: a checkpoint here would lose the accumulated gradients
        previous, self._agreement = (
            self._agreement,
            collectives.PendingReduction([float(self.preemption.received is not None)], op="max"),
        )
        signalled = previous is not None and previous.result()[0]
        if signalled and trainer.global_step < (trainer.max_steps if trainer.max_steps >= 0 else float("inf")):
            self._preempt(trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.preemption.uninstall()
        if self._agreement is not None:  # every rank started it: finish it so no collective is left in flight
            self._agreement.result()
            self._agreement = None

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.preemption.uninstall()

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
