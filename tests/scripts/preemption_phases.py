"""A tiny ZeRO-3 run on two CPU ranks whose rank 0 sends itself SIGTERM in one chosen phase of the Trainer's run.

Run as ``python preemption_phases.py '<json options>'`` (Lightning's launcher re-executes it for rank 1). ``phase`` is
one of ``load`` (inside the checkpoint restore of a resume from ``resume_from``), ``sanity`` (a sanity-check batch),
``fit_validation`` (a validation batch inside fit, after some steps), ``validate`` / ``test`` / ``predict`` (a batch of
that Trainer call), ``save`` (inside a regular ``ModelCheckpoint`` save) or ``train`` (a training step); any other
phase starting with ``fit_validation`` validates as ``fit_validation`` does and is not signalled (a resume). Rank 0
writes ``signal.json`` (wall-clock time of the signal) when it signals, and each rank ``rank<r>.json`` at exit (the
code it raised, the checkpoint it committed, its step).
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_hpz


class Regressor(L.LightningModule):
    def __init__(self, phase: str, out: Path) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
        self.phase = phase
        self.out = out
        self.signalled = False

    def signal_once(self, phase: str) -> None:
        if self.phase != phase or self.signalled or self.global_rank != 0:
            return
        self.signalled = True
        (self.out / "signal.json").write_text(json.dumps({"time": time.time(), "step": self.global_step}))
        os.kill(os.getpid(), signal.SIGTERM)

    def training_step(self, batch, batch_idx):
        if self.global_step == 3:
            self.signal_once("train")
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        if not self.trainer.sanity_checking and self.phase == "fit_validation":
            self.signal_once("fit_validation")
        elif self.trainer.sanity_checking:
            self.signal_once("sanity")
        elif self.phase == "validate":
            self.signal_once("validate")
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def test_step(self, batch, batch_idx):
        self.signal_once("test")
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def predict_step(self, batch, batch_idx):
        self.signal_once("predict")
        return self.net(batch[0])

    def on_save_checkpoint(self, checkpoint):
        self.signal_once("save")

    def on_load_checkpoint(self, checkpoint):
        self.signal_once("load")

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def data() -> DataLoader:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(256, 16, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True).sin()), batch_size=8, shuffle=False)


def main(options: dict) -> None:
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    phase = options["phase"]
    L.seed_everything(0, verbose=False)
    saving = phase == "save"
    trainer = L.Trainer(
        strategy=lightning_hpz.HpzStrategy(stage=3, hpz_partition_size=1),
        accelerator="cpu",
        devices=2,
        max_steps=options.get("steps", 12),
        limit_val_batches=6,
        val_check_interval=5 if phase.startswith("fit_validation") else None,
        num_sanity_val_steps=2 if phase == "sanity" else 0,
        callbacks=[ModelCheckpoint(dirpath=out / "regular", every_n_train_steps=4, save_top_k=-1)] if saving else [],
        default_root_dir=str(out / "root"),
        logger=False,
        enable_checkpointing=saving,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regressor(phase, out)
    record = {"exit": 0, "checkpoint": None}
    try:
        if phase in ("validate", "test", "predict"):
            getattr(trainer, phase)(model, data())
        else:
            val = data() if phase == "sanity" or phase.startswith("fit_validation") else None
            trainer.fit(model, data(), val, ckpt_path=options.get("resume_from"))
    except SystemExit as ended:
        record = {"exit": ended.code, "checkpoint": getattr(ended, "checkpoint", None)}
        raise
    finally:
        record["step"] = trainer.global_step
        (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
