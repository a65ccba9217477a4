"""What DeepSpeed's ZeRO-3 keeps gathered from forward to backward, per prefetch bucket and reuse distance.

    python benchmarks/zero3_retention.py      # 2 CPU processes, about two minutes

Eight equal Linear layers, hpZ 2 on 2 ranks: a parameter released after its forward gets an hpZ secondary shard, so
after the forward of step 3 (DeepSpeed decides from the module trace recorded in step 1) the shards show how many
layers were released. Prints one table (layers kept gathered); docs/autotune.md explains what the autotuner takes
from it.
"""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_hpz
from lightning_hpz.partitioning.secondary_partitions import has_secondary_partition, zero3_parameters

LAYERS, WIDTH = 8, 64
LAYER = WIDTH * WIDTH + WIDTH
REUSE_LAYERS = (0, 1, 2, 4, 6, 8, 12, 16)
BUCKETS = ((0, 0), (1, 10**9), (2, 10**9))  # (prefetch bucket in layers, live parameters)


class Stack(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
        self.kept_layers = 0.0

    def training_step(self, batch, batch_idx):
        loss = self.layers(batch[0]).pow(2).mean()
        released = sum(p.ds_numel for _, p in zero3_parameters(self) if has_secondary_partition(p))
        self.kept_layers = LAYERS - released / LAYER
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def kept_layers(prefetch_layers: int, live: int, reuse_layers: int) -> tuple[float, int]:
    L.seed_everything(0, verbose=False)
    thresholds = {
        "stage3_max_live_parameters": live,
        "stage3_max_reuse_distance": reuse_layers * LAYER,
        "stage3_prefetch_bucket_size": prefetch_layers * LAYER,
        "stage3_param_persistence_threshold": 0,
    }
    trainer = L.Trainer(
        strategy=lightning_hpz.HpzStrategy(hpz_partition_size=2, config={"zero_optimization": thresholds}),
        accelerator="cpu", devices=2, max_steps=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    model = Stack()
    trainer.fit(model, DataLoader(TensorDataset(torch.randn(64, WIDTH)), batch_size=4))
    return model.kept_layers, trainer.global_rank


def main() -> None:
    rows, rank = [], 0
    for prefetch_layers, live in BUCKETS:
        cells = []
        for reuse in REUSE_LAYERS:
            kept, rank = kept_layers(prefetch_layers, live, reuse)
            cells.append(f"{kept:g}")
        rows.append(f"| {prefetch_layers} layer(s), live {live:g} | " + " | ".join(cells) + " |")
    if rank == 0:
        print("layers kept gathered from forward to backward (of 8), by reuse distance in layers:")
        print("| prefetch bucket | " + " | ".join(str(r) for r in REUSE_LAYERS) + " |")
        print("| --- |" + " --- |" * len(REUSE_LAYERS))
        print("\n".join(rows))


if __name__ == "__main__":
    main()
