"""A user's ordinary LightningModule trained under lightning_hpz, launched as a script (one process per rank).

Run as ``python toy_training.py '<json options>'``: Lightning's launcher re-executes it once per extra rank, exactly
as a user's own script would be; or as under ``torchrun`` (the tests' warm launcher, ``run_script(ranks=N)``). Each
rank writes ``rank<r>.json`` into ``out`` with what the tests assert on.
"""

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_hpz
from lightning_hpz.callbacks.secondary_partition_check import SecondaryPartitionCheck
from lightning_hpz.partitioning import count_secondary_partitions


class RegressionData(Dataset):
    """Deterministic random features with a nonlinear target, built the same on every rank."""

    def __init__(self, size: int = 512, width: int = 32) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.x = torch.randn(size, width, generator=generator)
        self.y = torch.tanh(self.x @ torch.randn(width, 1, generator=generator))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]


class ToyRegressor(L.LightningModule):
    """Not one of lightning_hpz's models: an MLP of the kind any Lightning user writes."""

    def __init__(self, width: int = 32, nan_at_step: int = -1, fail_on_rank: int = -1) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
        self.nan_at_step = nan_at_step
        self.fail_on_rank = fail_on_rank
        self.losses: dict[int, float] = {}
        self.secondaries_seen: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_rank == self.fail_on_rank and self.global_step == 2:
            raise RuntimeError(f"deliberate failure on rank {self.global_rank}")
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.global_step == self.nan_at_step:
            loss = loss * float("nan")
        # After forward, hpZ keeps a secondary copy of each released parameter: count them for the tests.
        self.secondaries_seen.append(count_secondary_partitions(self))
        self.losses[self.global_step] = loss.item()
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)

    def train_dataloader(self):
        return DataLoader(RegressionData(), batch_size=8, shuffle=True)

    def on_train_end(self) -> None:
        # what the CLI tests read back: this rank's losses and the strategy's resolved settings
        out = os.environ.get("TOY_TRAINING_OUT")
        if out:
            strategy = self.trainer.strategy
            record = {"losses": self.losses, "strategy": type(strategy).__name__}
            record["zero_config"] = getattr(strategy, "config", {}).get("zero_optimization")
            Path(out).mkdir(parents=True, exist_ok=True)
            (Path(out) / f"rank{self.global_rank}.json").write_text(json.dumps(record))


def main(options: dict) -> None:
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(options.get("seed", 0), verbose=False)
    strategy = lightning_hpz.HpzStrategy(**options.get("strategy", {}))
    callbacks = []
    if options.get("check_every"):
        callbacks.append(SecondaryPartitionCheck(every_n_steps=options["check_every"]))
    if options.get("checkpoint_every"):
        callbacks.append(
            ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=options["checkpoint_every"], save_top_k=-1)
        )
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=options.get("devices", 4),
        max_steps=options.get("steps", 20),
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = ToyRegressor(nan_at_step=options.get("nan_at_step", -1), fail_on_rank=options.get("fail_on_rank", -1))
    data = DataLoader(RegressionData(), batch_size=8, shuffle=True)
    trainer.fit(model, data, ckpt_path=options.get("resume_from"))
    record = {
        "rank": trainer.global_rank,
        "losses": {str(k): v for k, v in model.losses.items()},
        "secondaries_seen": model.secondaries_seen,
        "hpz_partition_size": strategy.hpz_partition_size,
        "zero_config": strategy.config["zero_optimization"],
        "secondary_checks_run": strategy.secondary_checks_run,
        "callback_checks": [(c.checks_run, c.last_checked) for c in callbacks if hasattr(c, "checks_run")],
        "copy_ordering": {
            "mode": strategy.copy_ordering.mode,
            "events_recorded": strategy.copy_ordering.events_recorded,
            "events_waited": strategy.copy_ordering.events_waited,
            "host_syncs": strategy.copy_ordering.host_syncs,
        },
        "pid": os.getpid(),
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
