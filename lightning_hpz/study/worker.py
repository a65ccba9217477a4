"""Entry point of one rank of a study cell: ``python -m lightning_hpz.study.worker SPEC.json``.

Started once per cell by the study (Lightning's launcher then starts the other local ranks), or once per rank by
torchrun or srun (Lightning detects them). The spec (written by :mod:`lightning_hpz.study.cell_runner`) names the
model, strategy, micro-batch, precision, steps and output folder; each rank writes ``rank<r>.json`` there, or
``rank<r>.error.json`` when training raised.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

import lightning_hpz
from lightning_hpz.study.cell_strategy import strategy_kwargs
from lightning_hpz.study.measurement import CellMeasurement
from lightning_hpz.study.study_model import StudyModel, study_data


def build_strategy(spec: dict[str, Any]) -> lightning_hpz.HpzStrategy:
    cell = spec["cell"]
    kwargs = strategy_kwargs(cell["strategy"])
    if cell["hpz_partition_size"] > 1:
        kwargs["hpz_partition_size"] = cell["hpz_partition_size"]
    # logging_level: DeepSpeed's INFO lines would bury the cell's log.
    return lightning_hpz.HpzStrategy(config=spec["deepspeed_config"] or None, logging_level=40, **kwargs)


def build_trainer(spec: dict[str, Any], measurement: CellMeasurement) -> L.Trainer:
    return L.Trainer(
        strategy=build_strategy(spec),
        accelerator=spec["accelerator"],
        devices=spec["devices_per_node"],
        num_nodes=spec["nodes"],
        precision=spec["cell"]["precision"],
        max_steps=spec["steps"],
        limit_val_batches=0,
        callbacks=[measurement],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=spec["out"],
    )


def train(spec: dict[str, Any], measurement: CellMeasurement) -> L.Trainer:
    cell, model = spec["cell"], spec["model"]
    L.seed_everything(0, verbose=False)
    trainer = build_trainer(spec, measurement)
    samples = spec["steps"] * cell["micro_batch_size"] * spec["devices_per_node"] * spec["nodes"]
    data = study_data(model["family"], spec["data"], cell["micro_batch_size"], samples, spec["token_cache"])
    module = StudyModel(
        model["name"],
        model["family"],
        model["config"],
        learning_rate=spec["learning_rate"],
        activation_checkpointing=spec["activation_checkpointing"],
        lr_warmup_steps=spec.get("lr_warmup_steps", 0),  # specs written before the schedule existed: constant
        lr_min_ratio=spec.get("lr_min_ratio", 1.0),
    )
    trainer.fit(module, data)
    return trainer


def write_record(out: Path, rank: int, record: dict[str, Any], suffix: str = "") -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}{suffix}.json").write_text(json.dumps(record))


def rank_from_environment(spec: dict[str, Any]) -> int:
    """This process's global rank as its launcher set it (for failures before the Trainer knows it)."""
    for name in ("RANK", "SLURM_PROCID"):
        if name in os.environ:
            return int(os.environ[name])
    return int(os.environ.get("NODE_RANK", "0")) * spec["devices_per_node"] + int(os.environ.get("LOCAL_RANK", "0"))


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python -m lightning_hpz.study.worker SPEC.json")
    spec = json.loads(Path(argv[0]).read_text())
    out = Path(spec["out"])
    warnings.filterwarnings("ignore", category=FutureWarning)
    measurement = CellMeasurement()
    try:
        trainer = train(spec, measurement)
    except BaseException as err:
        rank = rank_from_environment(spec)
        error = {"rank": rank, "type": type(err).__name__, "message": str(err)[-2000:]}
        error["out_of_memory"] = isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()
        write_record(out, rank, {**error, "traceback": traceback.format_exc()[-4000:]}, suffix=".error")
        raise
    record = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "device": str(trainer.strategy.root_device),
        **measurement.record(spec["warmup_steps"]),
    }
    write_record(out, trainer.global_rank, record)


if __name__ == "__main__":
    main(sys.argv[1:])
