"""A Fabric loop written for FSDP-style strategies, run unchanged on DDP or on ``HpzFabricStrategy``.

Run as ``python fabric_client_loop.py '<json options>'`` under torchrun (or the test suite's warm launcher). The loop
is the one LitGPT and most FSDP examples use: ``fabric.setup(model)`` then ``fabric.setup_optimizers(optimizer)``
(``separate``), micro-batches under ``fabric.no_backward_sync`` with the loss divided by their count,
``fabric.clip_gradients(max_norm=...)``, ``optimizer.step()``. With ``reference_model`` a second model is set up
alone between the model and its optimizer (a policy and its reference, as in DPO). Every step trains on the same
global batch whatever the world size (each rank takes its slice, split into ``micro_batches``), so every
configuration computes the gradient of the same global mean loss. Each rank writes ``rank<r>.json``: the global loss
and the returned norm of each step, the engine's step count, and the messages of the calls that must be refused
(``probe_refusals``).
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch

import lightning_hpz

GLOBAL_BATCH = 16
FEATURES = 12


def build_strategy(options: dict):
    if options["strategy"] == "ddp":
        return "ddp"
    return lightning_hpz.HpzFabricStrategy(
        stage=options["stage"], hpz_partition_size=options.get("hpz", 1), config=options.get("config")
    )


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, FEATURES, generator=generator)
    return x, x.sin().sum(dim=1, keepdim=True)


def refusals(fabric: L.Fabric, model, optimizer) -> dict[str, str]:
    """What the strategy says to the calls it cannot honour (each must raise)."""
    messages = {}
    probes = {
        "second_setup_optimizers": lambda: fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1)),
        "clip_val": lambda: fabric.clip_gradients(model, optimizer, clip_val=1.0),
        "norm_type_inf": lambda: fabric.clip_gradients(model, optimizer, max_norm=1.0, norm_type=float("inf")),
        "closure": lambda: optimizer.step(lambda: torch.zeros(())),
    }
    probes["setup_optimizers_after_inference"] = lambda: _optimizer_after_inference(fabric)
    for name, call in probes.items():
        try:
            call()
        except Exception as error:  # the message is what the test reads
            messages[name] = f"{type(error).__name__}: {error}"
        else:
            messages[name] = "not refused"
    return messages


def _optimizer_after_inference(fabric: L.Fabric) -> None:
    """A model set up alone and run is an inference engine (as in Lightning); an optimizer cannot join it later."""
    model = fabric.setup(torch.nn.Linear(FEATURES, 1))
    assert model(torch.ones(2, FEATURES)).shape == (2, 1)
    fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))


def main(options: dict) -> None:
    world = options["devices"]
    fabric = L.Fabric(strategy=build_strategy(options), accelerator="cpu", devices=world)
    fabric.launch()
    fabric.seed_everything(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
    )
    if options.get("separate", True):
        model = fabric.setup(model)
        if options.get("reference_model"):  # set up alone too, after: the optimizer must find its own model
            fabric.setup(torch.nn.Linear(FEATURES, 1))
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=options.get("lr", 0.05)))
    else:
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=options.get("lr", 0.05)))
    micro = options["micro_batches"]
    local = GLOBAL_BATCH // world
    record = {"losses": [], "norms": []}
    for step in range(options["steps"]):
        x, y = global_batch(step)
        mine = slice(fabric.global_rank * local, (fabric.global_rank + 1) * local)
        x, y = x[mine], y[mine]
        total = torch.zeros(())
        for index, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
            with fabric.no_backward_sync(model, enabled=index < micro - 1):
                loss = (model(xs) - ys).pow(2).mean() / micro
                fabric.backward(loss, model=model)  # Fabric asks for it once two models are set up
            total += loss.detach()
        norm = fabric.clip_gradients(model, optimizer, max_norm=options["max_norm"])
        optimizer.step()
        optimizer.zero_grad()
        record["losses"].append(fabric.all_reduce(total, reduce_op="mean").item())
        record["norms"].append(norm.item())
    if options["strategy"] != "ddp":
        record["global_steps"] = fabric.strategy.model.global_steps
    if options.get("probe_refusals"):
        record["refusals"] = refusals(fabric, model, optimizer)
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(record))
    if options["strategy"] != "ddp":
        fabric.strategy.teardown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
