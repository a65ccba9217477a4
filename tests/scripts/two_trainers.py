"""Two hpZ Trainers in one process (fit, then a second fit of a new model), as notebooks and sweeps do."""

import json
import sys
from pathlib import Path

import lightning as L
from torch.utils.data import DataLoader
from toy_training import RegressionData, ToyRegressor

import lightning_hpz

REGATHER = {"stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0, "stage3_param_persistence_threshold": 0}


def fit_once(sizes: int) -> tuple[ToyRegressor, L.Trainer]:
    L.seed_everything(0, verbose=False)
    strategy = lightning_hpz.HpzStrategy(hpz_partition_size=sizes, config={"zero_optimization": REGATHER})
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=5, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    model = ToyRegressor()
    trainer.fit(model, DataLoader(RegressionData(), batch_size=8))
    return model, trainer


def main(options: dict) -> None:
    first, trainer = fit_once(2)
    second, _ = fit_once(2)
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    record = {"first": first.losses, "second": second.losses, "secondaries": second.secondaries_seen}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
