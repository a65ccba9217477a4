"""A plain Fabric loop whose optimizer steps must go through DeepSpeed's engine, on CPU processes.

Run as ``python fabric_engine_steps.py '<json options>'`` (Fabric's launcher starts the other ranks). The DeepSpeed
config carries a ``WarmupLR`` scheduler, which only the engine's ``step()`` advances; with ``own_scheduler`` the loop
passes its own scheduler to ``fabric.setup`` and steps it itself. The loop is the usual Fabric one:
``fabric.backward``, ``optimizer.step()``, ``optimizer.zero_grad()``. Each rank writes ``rank<r>.json``: the
engine's step counters and the learning rate after each step.
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch

import lightning_hpz

SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4,
                                            "warmup_type": "linear"}}  # fmt: skip


def main(options: dict) -> None:
    own_scheduler = options.get("own_scheduler", False)  # the loop's own scheduler, stepped by the loop
    config = {} if own_scheduler else {"scheduler": SCHEDULER}
    strategy = lightning_hpz.HpzFabricStrategy(stage=options["stage"], config=config)
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=2)
    fabric.launch()
    fabric.seed_everything(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5) if own_scheduler else None
    # with a scheduler (the loop's, or one the DeepSpeed config builds), Fabric hands it back third
    model, optimizer, scheduler = fabric.setup(model, optimizer, scheduler=scheduler)
    engine = fabric.strategy.model
    generator = torch.Generator().manual_seed(fabric.global_rank)
    rates = []
    for _ in range(options["steps"]):
        x = torch.randn(8, 16, generator=generator)
        loss = (model(x) - x[:, :1]).pow(2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if own_scheduler:
            scheduler.step()
        rates.append(optimizer.param_groups[0]["lr"])
    record = {"global_steps": engine.global_steps, "global_samples": engine.global_samples, "rates": rates}
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(record))
    fabric.strategy.teardown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
