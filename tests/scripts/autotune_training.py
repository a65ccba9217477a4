"""HpzStrategy(autotune=True) on two simulated nodes x 2 CPU ranks: tune, resume re-using the choice, explicit values.

Launched once per node (NODE_RANK=0/1, the same MASTER_PORT). Every rank writes what the tuner decided and what the
DeepSpeed engine was built with, for each phase, to rank<r>.json.
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_hpz
from lightning_hpz.autotune.memory_check import peak_memory_bytes

ENGINE_FIELDS = {
    "zero_hpz_partition_size": "zero_hpz_partition_size",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
}


def fit(out: Path, max_steps: int, ckpt_path=None, **strategy_kwargs) -> tuple[L.Trainer, dict]:
    L.seed_everything(0, verbose=False)
    strategy = lightning_hpz.HpzStrategy(**strategy_kwargs)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, num_nodes=2, max_steps=max_steps, default_root_dir=out,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(BoringModel(), ckpt_path=ckpt_path)
    zero_config = trainer.strategy.model._config.zero_config
    record = {
        "decision": strategy.autotune_decision.to_dict(),
        "strategy_config": {k: strategy.config["zero_optimization"].get(k) for k in ENGINE_FIELDS},
        "engine_config": {k: int(getattr(zero_config, field)) for k, field in ENGINE_FIELDS.items()},
        "global_step": trainer.global_step,
        "memory_check": vars(strategy.autotune_memory_check) if strategy.autotune_memory_check else None,
        "own_peak_bytes": peak_memory_bytes(torch.device("cpu")),
    }
    return trainer, record


def main(options: dict) -> None:
    out = Path(options["out"])
    records = {}
    trainer, records["tuned"] = fit(out, 2, autotune=True)
    checkpoint = out / "tuned.ckpt"
    trainer.save_checkpoint(checkpoint)
    _, records["resumed"] = fit(out, 4, ckpt_path=str(checkpoint), autotune=True)
    _, records["explicit"] = fit(
        out, 2, autotune="retune", hpz_partition_size=2, config={"zero_optimization": {"stage3_max_live_parameters": 0}}
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(records))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
