"""Fabric checkpoints of ZeRO-1, ZeRO-2 and ZeRO-3 + hpZ 2 moved to another number of ranks.

Run as ``python fabric_checkpoint_resize.py '<json options>'`` (tests/test_fabric_checkpoint_resize.py starts it as
torchrun would). For each ``(stage, hpz, optimizer)`` of ``options["layouts"]`` a new ``Fabric`` in the same
processes trains a model with two parameter groups (the matrices: weight decay 0.1, lr 1e-2; the biases: weight decay
0.0, lr 5e-3 and other betas, so that a group given the first group's settings shows). Phase ``"save"``: 3 steps, then
``fabric.save`` into ``root/<layout>``; rank 0 keeps the whole weights and Adam's whole moments it saved
(``saved_<layout>.pt``). Phase ``"load"`` (another number of ranks, hpZ off): ``fabric.load`` of that checkpoint into
a freshly built model; rank 0 keeps what was loaded (``loaded_<layout>.pt``), every rank records the groups' settings,
the loss of one more step and what it read of the converted copy, or the refusal (SGD with momentum: its state is not
converted).
"""

import json
import sys
from pathlib import Path

import deepspeed
import lightning as L
import torch
from deepspeed import DeepSpeedEngine
from fabric_toy_step import train_step
from optimizer_moments import whole_moments
from torch import nn

import lightning_hpz
from lightning_hpz.checkpointing.errors import CheckpointMismatchError

GROUP_SETTINGS = ("lr", "weight_decay", "betas", "momentum")


def build(fabric: L.Fabric, optimizer: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    with fabric.init_module():
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    named = list(model.named_parameters())
    matrices, vectors = [p for _, p in named if p.ndim > 1], [p for _, p in named if p.ndim <= 1]
    if optimizer == "sgd":
        groups = [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0, "lr": 5e-3}]
        return fabric.setup(model, torch.optim.SGD(groups, lr=1e-2, momentum=0.9))
    groups = [
        {"params": matrices, "weight_decay": 0.1},
        {"params": vectors, "weight_decay": 0.0, "lr": 5e-3, "betas": (0.8, 0.99)},
    ]
    return fabric.setup(model, torch.optim.AdamW(groups, lr=1e-2))


def whole_state(model: nn.Module, stage: int) -> dict[str, torch.Tensor]:
    """Every parameter whole (fp32 master weights are the module's in fp32 training) and Adam's moments, whole."""
    engine = next(m for m in model.modules() if isinstance(m, DeepSpeedEngine))
    named = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in named], enabled=stage == 3):
        weights = {name: p.detach().clone().cpu() for name, p in named}
    return {**weights, **whole_moments(engine.optimizer, named, stage)}


def run_layout(fabric: L.Fabric, stage: int, optimizer_name: str, phase: str, root: Path, out: Path) -> dict:
    model, optimizer = build(fabric, optimizer_name)
    layout = f"stage{stage}_{optimizer_name}"
    folder = root / layout
    if phase == "load" and optimizer_name == "sgd":
        try:
            fabric.load(folder, {"model": model, "optimizer": optimizer})
        except CheckpointMismatchError as refusal:
            return {"refused": str(refusal)}
        return {"refused": None}
    if phase == "save":
        losses = [train_step(fabric, model, optimizer, step) for step in range(3)]
        state = whole_state(model, stage) if optimizer_name != "sgd" else None  # SGD has no moments to compare
        fabric.save(folder, {"model": model, "optimizer": optimizer, "step": 3})
        record = {"losses": losses}
    else:
        loaded = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(folder, loaded)
        state = whole_state(model, stage)
        record = {"step": loaded["step"], "next_loss": train_step(fabric, model, optimizer, 3)}
        record["universal_reads"] = fabric.strategy.universal_reads.as_dict()  # what this rank read of the copy
    if fabric.global_rank == 0 and state is not None:
        torch.save(state, out / f"{'saved' if phase == 'save' else 'loaded'}_{layout}.pt")
    record["groups"] = [{key: group.get(key) for key in GROUP_SETTINGS} for group in optimizer.param_groups]
    return record


def main(options: dict) -> None:
    root, out = Path(options["root"]), Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    record = {}
    for stage, hpz, optimizer in options["layouts"]:
        hpz = hpz if options["phase"] == "save" else 1
        strategy = lightning_hpz.HpzFabricStrategy(stage=stage, hpz_partition_size=hpz)
        fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=options["devices"])
        fabric.launch()
        fabric.seed_everything(0)
        record[f"stage{stage}_{optimizer}"] = run_layout(fabric, stage, optimizer, options["phase"], root, out)
        strategy.teardown()  # releases the folder's writer lock
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
