"""One node of a two-node Lightning job under lightning_hpz that a fault may hit: a node lost, the link cut or slowed.

Run as ``python peer_loss_training.py '<json options>'`` once per node, with ``NODE_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` set (Lightning's launcher starts the node's other ranks). ZeRO-3 on an MLP large enough that a slowed
link is full of all-gathers; a committed checkpoint every ``checkpoint_every`` steps. Each rank rewrites
``rank<r>.json`` in ``out`` after every step: the step, the last committed checkpoint, the slowest heartbeat round
trip so far, the heartbeat calls that failed, and, at a normal exit, ``exit: 0``.
"""

import json
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_hpz


class Wide(L.LightningModule):
    def __init__(self, width: int, step_seconds: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, width))
        self.step_seconds = step_seconds

    def training_step(self, batch, batch_idx):
        (x,) = batch
        time.sleep(self.step_seconds)
        return nn.functional.mse_loss(self.net(x), x.flip(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Record(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out
        self.slowest = 0.0
        self.failed_calls = 0

    def write(self, trainer: L.Trainer, **extra) -> None:
        watchdog = trainer.strategy.peer_watchdog
        if watchdog is not None:
            self.slowest = max(self.slowest, watchdog.slowest_round_trip)
            self.failed_calls = watchdog.failed_calls
        record = {
            "rank": trainer.global_rank,
            "step": trainer.global_step,
            "time": time.time(),
            "committed": trainer.strategy.committed_checkpoint,
            "slowest_heartbeat_s": self.slowest,
            "failed_heartbeat_calls": self.failed_calls,
            **extra,
        }
        path = self.out / f"rank{trainer.global_rank}.json"
        path.with_suffix(".tmp").write_text(json.dumps(record))
        path.with_suffix(".tmp").replace(path)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.write(trainer)


def main(options: dict) -> None:
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0, verbose=False)
    record = Record(out)
    width = options.get("width", 256)
    checkpoints = ModelCheckpoint(
        dirpath=out / "ckpt", filename="{step}", every_n_train_steps=options.get("checkpoint_every", 3), save_top_k=-1
    )
    strategy = lightning_hpz.HpzStrategy(stage=3, peer_timeout=options.get("peer_timeout", 45.0))
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=options.get("devices", 1),
        num_nodes=2,
        max_steps=options.get("steps", 1000),
        callbacks=[record, checkpoints],
        default_root_dir=str(out / "root"),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = TensorDataset(torch.randn(4096, width, generator=torch.Generator().manual_seed(3)))
    trainer.fit(Wide(width, options.get("step_seconds", 0.3)), DataLoader(data, batch_size=8))
    record.write(trainer, exit=0)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
