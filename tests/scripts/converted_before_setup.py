"""A script that builds its model inside ``deepspeed.zero.Init`` before lightning_hpz is even imported, then trains
it with hpZ under the strategy; run under torchrun (2 ranks). Each rank writes ``rank<r>.json`` into ``out``.

Under the CPU race emulation every secondary copy lands only once something orders after it: a gather DeepSpeed
gave these parameters before the strategy existed would read poison, unless the strategy orders it at setup.
"""

import json
import math
import sys
from pathlib import Path

import deepspeed
import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

REGATHER = {
    "stage3_max_live_parameters": 0,
    "stage3_max_reuse_distance": 0,
    "stage3_param_persistence_threshold": 0,
    "stage3_prefetch_bucket_size": 0,
}


class Regressor(L.LightningModule):
    """A plain MLP module; deliberately not toy_training's, whose import would load lightning_hpz first."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
        self.losses: dict[int, float] = {}
        self.secondaries_seen: list[int] = []

    def training_step(self, batch, batch_idx):
        from lightning_hpz.partitioning import count_secondary_partitions

        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.secondaries_seen.append(count_secondary_partitions(self))
        self.losses[self.global_step] = loss.item()
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def regression_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(256, 32, generator=generator)
    return TensorDataset(x, torch.tanh(x @ torch.randn(32, 1, generator=generator)))


def main(options: dict) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    zero = {"stage": 3, "zero_hpz_partition_size": 2, **REGATHER}
    L.seed_everything(0, verbose=False)
    with deepspeed.zero.Init(config_dict_or_path={"zero_optimization": zero, "train_micro_batch_size_per_gpu": 8}):
        model = Regressor()

    import lightning_hpz  # only now: nothing of it saw the conversion above
    from lightning_hpz.callbacks import SecondaryPartitionCheck

    strategy = lightning_hpz.HpzStrategy(
        hpz_partition_size=2, hpz_sync=options["mode"], emulate_async_copy=True, config={"zero_optimization": REGATHER}
    )
    check = SecondaryPartitionCheck(every_n_steps=2)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=6, callbacks=[check], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, DataLoader(regression_data(), batch_size=8))
    record = {
        "losses_finite": all(math.isfinite(v) for v in model.losses.values()),
        "steps": len(model.losses),
        "checks": check.checks_run,
        "secondaries": max(model.secondaries_seen),
        "ordered_gathers": sum(
            p.all_gather_coalesced.__module__.startswith("lightning_hpz") for p in model.parameters()
        ),
        "parameters": len(list(model.parameters())),
        "events_waited": strategy.copy_ordering.events_waited,
    }
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
