"""A user's script whose Trainer raises on some ranks, with the user's own ``except`` clean-up, on 2 processes.

Run as ``python rank_failure.py '<json options>'``: ``phase`` ("fit" or "test") raises at its third batch on each rank
of ``fail_on_ranks``; the other ranks go on into that batch's forward, whose ZeRO-3 all-gather waits for the failed
rank. With ``catch``, each rank that gets an exception spends ``cleanup_seconds`` on its clean-up, then writes
``rank<r>.json`` from its ``except`` block.
"""

import json
import sys
import threading
import time
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader
from toy_training import RegressionData

import lightning_hpz

REGATHER = {"stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0, "stage3_param_persistence_threshold": 0}


class FailingRegressor(L.LightningModule):
    """A plain MLP that fails at the third batch of one phase on chosen ranks."""

    def __init__(self, phase: str, fail_on_ranks: list[int]) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1))
        self.phase, self.fail_on_ranks = phase, fail_on_ranks

    def _maybe_fail(self, phase: str, batch_idx: int) -> None:
        if phase == self.phase and batch_idx == 2 and self.global_rank in self.fail_on_ranks:
            raise RuntimeError(f"deliberate failure on rank {self.global_rank}")

    def training_step(self, batch, batch_idx):
        self._maybe_fail("fit", batch_idx)
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def test_step(self, batch, batch_idx):
        self._maybe_fail("test", batch_idx)
        self.log("test_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main(options: dict) -> None:
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    strategy = lightning_hpz.HpzStrategy(
        stage=3, hpz_partition_size=2, failure_grace_period=options["grace"], config={"zero_optimization": REGATHER}
    )
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=6, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    model = FailingRegressor(options["phase"], options["fail_on_ranks"])
    data = DataLoader(RegressionData(size=64), batch_size=4)
    try:
        trainer.fit(model, data) if options["phase"] == "fit" else trainer.test(model, data, verbose=False)
    except Exception as err:
        if not options["catch"]:
            raise
        # what the strategy started must be stopped by now (Lightning's own tests fail on a thread left running)
        threads_left = sorted(t.name for t in threading.enumerate() if t.name.startswith("lightning-hpz"))
        time.sleep(options.get("cleanup_seconds", 0))  # the user's clean-up: saving, uploading logs, ...
        record = {"rank": trainer.global_rank, "caught": f"{type(err).__name__}: {err}"[:400], "cleanup_done": True}
        record["threads_left"] = threads_left
        (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
