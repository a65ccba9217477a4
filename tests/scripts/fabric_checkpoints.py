"""A Fabric loop under ``HpzFabricStrategy`` (ZeRO-3, two CPU ranks) that saves, loads, and is killed while saving.

Run as ``python fabric_checkpoints.py '<json options>'`` (tests/test_fabric_checkpoints.py starts it as torchrun
would). Phase ``"first"``: train 2 steps and save ``saved/a``; load it into a freshly built model and compare every
rank's weight shards, optimizer state and step counter with those saved; refuse ``fabric.save(..., filter=...)``;
load a copy of ``a`` with one shard damaged (refused on every rank); train on, save ``run/last`` at step 3, train step
3, and save ``run/last`` again, which the test kills at a commit fault point (``LIGHTNING_HPZ_FAULT_POINT``). Phase
``"after_kill"``, on ``devices`` ranks: load ``run/last``, train step 3 again and save; then load ``saved/a``, which
the test left as a commit killed between its two renames leaves it. The checkpoints live under ``root``; each rank
writes ``rank<r>.json`` into ``out`` (the first phase before the save that is killed).
"""

import json
import shutil
import sys
from pathlib import Path

import lightning as L
import torch
from deepspeed import DeepSpeedEngine
from fabric_toy_step import train_step
from torch import nn

import lightning_hpz
from lightning_hpz.checkpointing.errors import CheckpointIntegrityError

DAMAGED_FILE = "checkpoint/zero_pp_rank_1_mp_rank_00_optim_states.pt"


def build(fabric: L.Fabric) -> tuple[nn.Module, torch.optim.Optimizer]:
    with fabric.init_module():
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    return fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def held_state(model: nn.Module) -> list[torch.Tensor]:
    """This rank's shards of the weights, the fp32 master partitions with Adam's state, and the engine's step."""
    engine = next(m for m in model.modules() if isinstance(m, DeepSpeedEngine))
    tensors = [p.ds_tensor.detach().clone() for p in engine.module.parameters()]
    inner = engine.optimizer.optimizer  # the torch AdamW over this rank's fp32 partitions
    for group in inner.param_groups:
        for master in group["params"]:
            tensors.append(master.detach().clone())
            tensors += [torch.as_tensor(value).clone() for _, value in sorted(inner.state[master].items())]
    return [*tensors, torch.tensor(engine.global_steps)]


def same(first: list[torch.Tensor], second: list[torch.Tensor]) -> bool:
    return len(first) == len(second) and all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def first_phase(fabric: L.Fabric, root: Path, out: Path, record: dict) -> None:
    model, optimizer = build(fabric)
    for step in range(2):
        train_step(fabric, model, optimizer, step)
    saved = held_state(model)
    fabric.save(root / "saved" / "a", {"model": model, "optimizer": optimizer, "step": 2, "note": "kept"})
    try:
        fabric.save(root / "saved" / "refused", {"model": model}, filter={"model": lambda name, value: True})
    except TypeError as refusal:
        record["filter_refusal"] = str(refusal)

    model, optimizer = build(fabric)  # a fresh model and optimizer, as a resumed run builds them
    state = {"model": model, "optimizer": optimizer, "step": 0}
    remainder = fabric.load(root / "saved" / "a", state)
    record.update(loaded_step=state["step"], remainder=sorted(remainder), exact=same(saved, held_state(model)))
    record["verified_in_load"] = fabric.strategy.files_verified_in_load  # checked again from the bytes loaded

    if fabric.global_rank == 0:  # a copy beside `a` with one byte of one shard flipped, sizes unchanged
        shutil.copytree(root / "saved" / "a", root / "saved" / "damaged")
        shard = root / "saved" / "damaged" / DAMAGED_FILE
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    fabric.barrier()
    try:
        fabric.load(root / "saved" / "damaged", {"model": model, "optimizer": optimizer})
    except CheckpointIntegrityError as refusal:
        record["integrity_refusal"] = str(refusal)

    record["losses"] = {2: train_step(fabric, model, optimizer, 2)}
    fabric.save(root / "run" / "last", {"model": model, "optimizer": optimizer, "step": 3})
    record["losses"][3] = train_step(fabric, model, optimizer, 3)
    write(out, fabric, record)
    # killed here when the test sets the fault point (rank 0 reaches it, and kills the whole job)
    fabric.save(root / "run" / "last", {"model": model, "optimizer": optimizer, "step": 4})


def after_kill_phase(fabric: L.Fabric, root: Path, record: dict) -> None:
    model, optimizer = build(fabric)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(root / "run" / "last", state)
    engine_step = next(m for m in model.modules() if isinstance(m, DeepSpeedEngine)).global_steps
    record.update(loaded_step=state["step"], engine_step=engine_step)
    record["losses"] = {3: train_step(fabric, model, optimizer, 3)}
    fabric.save(root / "run" / "last", {"model": model, "optimizer": optimizer, "step": 4})
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(root / "saved" / "a", state)  # missing at its path: repaired first
    record["repaired_step"] = state["step"]


def write(out: Path, fabric: L.Fabric, record: dict) -> None:
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(record))
    fabric.barrier()  # rank 0 ends, or reaches the killed save, after every rank has written


def main(options: dict) -> None:
    root, out = Path(options["root"]), Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    strategy = lightning_hpz.HpzFabricStrategy(stage=3, hpz_partition_size=1)
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=options.get("devices", 2))
    fabric.launch()
    fabric.seed_everything(0)
    record: dict = {}
    if options["phase"] == "first":
        first_phase(fabric, root, out, record)
    else:
        after_kill_phase(fabric, root, record)
        strategy.teardown()  # releases the folder's writer lock
        write(out, fabric, record)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
