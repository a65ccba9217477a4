"""An ordinary MLP trained under lightning_hpz until a scheduler preempts it (SIGTERM/SIGUSR1), or to the end.

Run as ``python preemption_training.py '<json options>'`` (Lightning's launcher re-executes it once per extra rank) or
under ``torchrun``. Each rank rewrites ``rank<r>.json`` in ``out`` after every step: the losses so far, the step
reached, and, at exit, how fit ended. Steps sleep a little so that a signal lands mid-training, not after it.
"""

import json
import sys
import time
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_hpz


class SlowRegressor(L.LightningModule):
    def __init__(self, step_seconds: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
        self.step_seconds = step_seconds
        self.losses: dict[str, float] = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses[str(self.global_step)] = loss.item()
        time.sleep(self.step_seconds)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def data() -> DataLoader:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(512, 16, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True).sin()), batch_size=8, shuffle=False)


class Record(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def write(self, trainer: L.Trainer, model: SlowRegressor, **extra) -> None:
        record = {"losses": model.losses, "step": trainer.global_step, **extra}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.write(trainer, pl_module)


def main(options: dict) -> None:
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0, verbose=False)
    record = Record(out)
    trainer = L.Trainer(
        strategy=lightning_hpz.HpzStrategy(stage=options.get("stage", 2), hpz_partition_size=1),
        accelerator="cpu",
        devices=options.get("devices", 2),
        max_steps=options.get("steps", 30),
        callbacks=[record],
        default_root_dir=str(out / "root"),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = SlowRegressor(options.get("step_seconds", 0.2))
    try:
        trainer.fit(model, data(), ckpt_path=options.get("resume_from"))
    except SystemExit as ended:
        record.write(trainer, model, exit=ended.code, checkpoint=getattr(ended, "checkpoint", None))
        raise
    record.write(trainer, model, exit=0)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
