"""Fits that resume by name (``ckpt_path="hpc"``, ``"last"``, SLURM's auto-resume) from a run's preemption checkpoints
and ``last.ckpt``, one after the other in the same processes.

Run as ``python resume_by_name.py '<json options>'`` (Lightning's launcher starts the other rank), under torchrun,
or as SLURM tasks. ``options["jobs"]``: each
``{"max_steps", "ckpt_path", "preempt_at": [steps], "fault_point", "fault_step"}``. Preemption checkpoints are saved
as ``PreemptionCheckpoint`` saves them (``<root>/hpc_ckpt_<N>.ckpt``, which retires the older ones) at the steps in
``preempt_at``, without a signal so that the processes go on to the next job. ``ModelCheckpoint`` saves only
``last.ckpt``, every 2 steps, into ``<root>/checkpoints``. ``fault_point`` kills rank 0 (SIGKILL) at that point of the
commit at ``fault_step``; ``options["renames"]`` commits with two renames, as on a file system without an atomic
exchange. Each rank writes ``rank<r>.json``: per job the step it started at, the step it ended at, the path it
resumed, and the checkpoints in the run's folders afterwards.
"""

import json
import os
import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader
from toy_training import RegressionData, ToyRegressor

import lightning_hpz
from lightning_hpz.checkpointing import commit
from lightning_hpz.checkpointing.fault_points import FAULT_POINT_ENV_VAR
from lightning_hpz.lifecycle.preemption_checkpoint import next_preemption_checkpoint


class SaveAsPreempted(L.Callback):
    """At the steps given, what ``PreemptionCheckpoint`` does on a signal, except that training goes on."""

    def __init__(self, steps: list[int]) -> None:
        self.steps = set(steps)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step in self.steps:
            self.steps.discard(trainer.global_step)
            trainer.save_checkpoint(trainer.strategy.broadcast(next_preemption_checkpoint(trainer.default_root_dir)))


class Record(L.Callback):
    def __init__(self, job: dict) -> None:
        self.job = job
        self.start_step = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.start_step = trainer.global_step

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if trainer.global_step == self.job.get("fault_step") and trainer.global_rank == 0:
            os.environ[FAULT_POINT_ENV_VAR] = self.job["fault_point"]


def fit(job: dict, options: dict) -> dict:
    L.seed_everything(0, verbose=False)
    root = Path(options["root"])
    record = Record(job)
    trainer = L.Trainer(
        strategy=lightning_hpz.HpzStrategy(stage=2), accelerator="cpu", devices=options.get("devices", 2),
        max_steps=job["max_steps"], default_root_dir=root, logger=False,
        callbacks=[
            ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=2, save_top_k=0, save_last=True),
            SaveAsPreempted(job.get("preempt_at", [])),
            record,
        ],
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(ToyRegressor(), DataLoader(RegressionData(), batch_size=8), ckpt_path=job.get("ckpt_path"))
    folders = {name: sorted(p.name for p in (root / name).iterdir()) for name in (".", "checkpoints")}
    resumed = str(trainer.ckpt_path) if trainer.ckpt_path else None
    return {
        "rank": trainer.global_rank,
        "start_step": record.start_step,
        "end_step": trainer.global_step,
        "resumed": resumed,
        "folders": folders,
    }


def main(options: dict) -> None:
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    if options.get("renames"):
        commit.atomic_exchange = lambda first, second: False  # a file system that cannot exchange (NFS, Lustre)
    records = [fit(job, options) for job in options["jobs"]]
    (out / f"rank{records[-1]['rank']}.json").write_text(json.dumps({"jobs": records}))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
