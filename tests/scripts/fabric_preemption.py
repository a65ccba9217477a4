"""A Fabric loop under ``HpzFabricStrategy`` (ZeRO-3, two CPU ranks) that polls for preemption after every step.

Run as ``python fabric_preemption.py '<json options>'``. Rank 0 sends itself SIGTERM inside step ``signal_at``; every
rank asks ``fabric.strategy.preemption_requested()`` after ``optimizer.step()``, and when the answer is yes all save
and leave together with ``TrainingPreempted`` (exit 75). Each rank writes ``rank<r>.json`` (step, exit code,
checkpoint); rank 0 writes ``signal.json`` (wall-clock time of the signal).
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import lightning as L
import torch
from torch import nn

import lightning_hpz
from lightning_hpz.lifecycle.run_exit import TrainingPreempted


def main(options: dict) -> None:
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    strategy = lightning_hpz.HpzFabricStrategy(stage=3, hpz_partition_size=1)
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=2)
    fabric.launch()
    fabric.seed_everything(0)
    with fabric.init_module():
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    record = {"exit": 0, "checkpoint": None, "step": 0}
    try:
        for step in range(options.get("steps", 12)):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
            loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin())
            if step == options["signal_at"] and fabric.global_rank == 0:
                (out / "signal.json").write_text(json.dumps({"time": time.time(), "step": step}))
                os.kill(os.getpid(), signal.SIGTERM)
            fabric.backward(loss, model=model)
            optimizer.step()
            optimizer.zero_grad()
            record["step"] = step + 1
            if fabric.strategy.preemption_requested():  # every rank, same point: the same answer
                path = out / f"preempted-{step + 1}"
                fabric.save(path, {"model": model, "optimizer": optimizer, "step": step + 1})
                raise TrainingPreempted(f"preempted at step {step + 1}", fabric, str(path))
    except SystemExit as ended:
        record.update(exit=ended.code, checkpoint=getattr(ended, "checkpoint", None))
        raise
    finally:
        strategy.teardown()
        (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
