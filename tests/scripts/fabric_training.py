"""A custom Fabric training loop under ``HpzFabricStrategy``, launched as a script (one process per rank).

Run as ``python fabric_training.py '<json options>'``: Fabric's launcher re-executes it once per extra rank, as it
would a user's own script. The loop trains a tiny transformers ``LlamaForCausalLM`` (built sharded under
``fabric.init_module()``, as LitGPT builds its models) for ``steps`` steps and saves a sharded checkpoint after
``save_at`` of them; then a second model, built and set up the same way, loads that checkpoint and trains the
remaining steps. Each rank writes
``rank<r>.json`` into ``out`` with what the tests assert on.
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import lightning_hpz
from lightning_hpz.models import get_preset
from lightning_hpz.partitioning import count_secondary_partitions

# The llama2-tiny preset is only a config: the model is a plain transformers Llama (grouped-query attention, as in
# Llama-2-70B), not one of lightning_hpz's LightningModules.
LLAMA = get_preset("llama2-tiny").config
BATCH, SEQUENCE = 4, 12


def batch_for(step: int, rank: int) -> torch.Tensor:
    """The same batch for a given step and rank in every run, whatever came before (so a resumed run sees it too)."""
    generator = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randint(LLAMA["vocab_size"], (BATCH, SEQUENCE), generator=generator)


def build(fabric: L.Fabric) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    with fabric.init_module():
        model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    # ZeRO-3 init: each rank holds only its shard of every parameter from construction on
    shards = {
        "local": sum(p.ds_tensor.numel() for p in model.parameters()),
        "full": sum(p.ds_numel for p in model.parameters()),
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    return model, optimizer, shards


def train(fabric: L.Fabric, model, optimizer, steps: range, options: dict, record: dict) -> None:
    for step in steps:
        tokens = batch_for(step, fabric.global_rank)
        loss = model(input_ids=tokens, labels=tokens).loss
        record["secondaries_seen"].append(count_secondary_partitions(model))
        if options.get("check_every") and step % options["check_every"] == 0:
            # between forward and backward: the secondaries the backward gathers will read exist now
            report = fabric.strategy.check_secondary_partitions()
            record["explicit_checks"].append([step, report.checked])
        if step == options.get("refresh_at"):
            # as after writing sharded weights by hand: drop the secondaries, backward gathers from the primaries
            record["refreshed"].append([step, fabric.strategy.refresh_secondary_partitions()])
        fabric.backward(loss, model=model)  # the model argument: the resumed run is a second model
        optimizer.step()
        optimizer.zero_grad()
        record["losses"][str(step)] = loss.item()
        if step + 1 == options.get("save_at"):
            fabric.save(Path(options["out"]) / "ckpt", {"model": model, "optimizer": optimizer, "step": step + 1})


def main(options: dict) -> None:
    out = Path(options["out"])
    strategy = lightning_hpz.HpzFabricStrategy(**options["strategy"])
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=4)
    fabric.launch()
    fabric.seed_everything(0)
    record: dict = {"losses": {}, "resumed_losses": {}, "secondaries_seen": [], "explicit_checks": [], "refreshed": []}
    model, optimizer, record["shards"] = build(fabric)
    train(fabric, model, optimizer, range(options["steps"]), options, record)
    if options.get("save_at"):
        model, optimizer, _ = build(fabric)
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(out / "ckpt", state)
        record["loaded_step"] = state["step"]
        resumed = {**record, "losses": record["resumed_losses"]}
        train(fabric, model, optimizer, range(state["step"], options["steps"]), {**options, "save_at": None}, resumed)
    ordering = strategy.copy_ordering
    record.update(
        hpz_partition_size=strategy.hpz_partition_size,
        secondary_checks_run=strategy.secondary_checks_run,
        copy_ordering={
            "events_recorded": ordering.events_recorded,
            "events_waited": ordering.events_waited,
            "host_syncs": ordering.host_syncs,
        },
    )
    strategy.teardown()  # Fabric never calls it; it undoes what setup installed in DeepSpeed
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(record))
    fabric.barrier()  # rank 0 is the process the test waits for: it ends after every rank has written


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
