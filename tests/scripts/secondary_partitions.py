"""Stale and corrupted secondary partitions, on real ZeRO-3 shards over 4 CPU processes.

After a training step and an evaluation forward (which leaves fresh secondary copies), every primary shard is
halved in place, as low-level weight loaders do. The next forward is recorded before and after
``refresh_secondary_partitions``; the integrity check is run on healthy, stale and deliberately corrupted shards.
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader
from toy_training import RegressionData, ToyRegressor

import lightning_hpz
from lightning_hpz.partitioning import (
    SecondaryPartitionMismatchError,
    check_secondary_partitions,
    count_secondary_partitions,
    refresh_secondary_partitions,
)

REGATHER = {"stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0, "stage3_param_persistence_threshold": 0}


def forward_sum(module, x) -> float:
    with torch.no_grad():
        return module.net(x).sum().item()


def check_summary(module) -> dict:
    report = check_secondary_partitions(module, raise_on_mismatch=False)
    return {"ok": report.ok, "checked": report.checked, "mismatched": report.mismatched}


def main(options: dict) -> None:
    import deepspeed

    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0, verbose=False)
    strategy = lightning_hpz.HpzStrategy(hpz_partition_size=options["hpz"], config={"zero_optimization": REGATHER})
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=4,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(ToyRegressor(), DataLoader(RegressionData(), batch_size=8))
    module = trainer.lightning_module
    module.eval()
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(7))
    record = {"rank": trainer.global_rank, "after_eval": forward_sum(module, x)}
    record["secondaries_after_eval"] = count_secondary_partitions(module)
    record["check_healthy"] = check_summary(module)

    for param in module.parameters():
        param.ds_tensor.mul_(0.5)  # a direct write into the primary shards
    record["stale_forward"] = forward_sum(module, x)
    record["check_stale"] = check_summary(module)
    record["dropped"] = refresh_secondary_partitions(module)
    record["refreshed_forward"] = forward_sum(module, x)

    name, first = next(iter(module.named_parameters()))
    if trainer.global_rank == 1 and first.ds_secondary_tensor is not None:
        first.ds_secondary_tensor.add_(1.0)
    try:
        check_secondary_partitions(module)
        record["corruption_error"] = None
    except SecondaryPartitionMismatchError as error:
        record["corruption_error"] = str(error)
    record["corrupted_param"] = name

    # a load_state_dict into the sharded model (under GatheredParameters) must not leave stale copies behind
    refresh_secondary_partitions(module)
    forward_sum(module, x)
    state = {k: v * 2 for k, v in _full_state_dict(module).items()}
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0):
        if trainer.global_rank == 0:
            module.load_state_dict(state)
    record["after_load_state_dict"] = forward_sum(module, x)
    record["check_after_load_state_dict"] = check_summary(module)

    # a write under GatheredParameters(modifier_rank=0) outside load_state_dict, as transformers'
    # resize_token_embeddings copies the old rows: DeepSpeed before 0.18.3 kept the old secondaries (#7606, #7130)
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0), torch.no_grad():
        if trainer.global_rank == 0:
            for param in module.parameters():
                param.mul_(-1.5)
    record["after_gathered_write"] = forward_sum(module, x)
    record["check_after_gathered_write"] = check_summary(module)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def _full_state_dict(module) -> dict:
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        return {k: v.detach().clone() for k, v in module.state_dict().items()}


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
