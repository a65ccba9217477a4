"""What DeepSpeed really keeps gathered from forward to backward under each autotune retention profile.

2 CPU ranks, hpZ 2: a parameter released after its forward gets an hpZ secondary shard, one kept gathered does not,
so after the forward of step 3 (the trace is recorded in step 1) the secondary shards tell which share was released.
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_hpz
from lightning_hpz.autotune.tuner import model_facts
from lightning_hpz.partitioning.secondary_partitions import has_secondary_partition, zero3_parameters
from lightning_hpz.planning.tuning import PERSISTENCE, profile_thresholds

LAYERS, WIDTH = 8, 64


class Stack(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
        self.released_share: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.layers(batch[0]).pow(2).mean()
        params = list(zero3_parameters(self))
        released = sum(p.ds_numel for _, p in params if has_secondary_partition(p))
        self.released_share.append(released / sum(p.ds_numel for _, p in params))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def measure(profile: str) -> dict:
    L.seed_everything(0, verbose=False)
    model = Stack()
    thresholds = {**profile_thresholds(profile, model_facts(model), 0), PERSISTENCE: 0}
    strategy = lightning_hpz.HpzStrategy(hpz_partition_size=2, config={"zero_optimization": thresholds})
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = TensorDataset(torch.randn(64, WIDTH))
    trainer.fit(model, DataLoader(data, batch_size=4))
    return {"thresholds": thresholds, "released_share": model.released_share, "rank": trainer.global_rank}


def main(options: dict) -> None:
    records = {profile: measure(profile) for profile in ("release", "half", "keep")}
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{records['keep']['rank']}.json").write_text(json.dumps(records))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
