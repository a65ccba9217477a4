"""Training interleaved with evaluation under the context a GPU run of Lightning uses, on CPU processes.

Run as ``python evaluation_modes.py '<json options>'`` (Fabric's launcher starts the other ranks). A tiny Llama is
built sharded under ``fabric.init_module()``; optionally every layer but the last is frozen (LoRA-style: DeepSpeed
never drops the secondary copies of frozen parameters). Every ``eval_every`` steps the model evaluates a fixed batch
under ``eval_context`` ("inference_mode", as Lightning's loops on CUDA; "no_grad", as on gloo; or "grad"). Each rank
writes ``rank<r>.json`` with the training and evaluation losses.
"""

import contextlib
import json
import sys
from pathlib import Path

import lightning as L
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import lightning_hpz
from lightning_hpz.models import get_preset
from lightning_hpz.partitioning import count_secondary_partitions

LLAMA = get_preset("llama2-tiny").config
BATCH, SEQUENCE = 4, 12
CONTEXTS = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad, "grad": contextlib.nullcontext}


def batch_for(step: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randint(LLAMA["vocab_size"], (BATCH, SEQUENCE), generator=generator)


def main(options: dict) -> None:
    out = Path(options["out"])
    strategy = lightning_hpz.HpzFabricStrategy(**options["strategy"])
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=4)
    fabric.launch()
    fabric.seed_everything(0)
    with fabric.init_module():
        model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    if options.get("freeze"):
        for name, parameter in model.named_parameters():
            parameter.requires_grad = "layers.1." in name
    trainable = [p for p in model.parameters() if p.requires_grad]
    model, optimizer = fabric.setup(model, torch.optim.AdamW(trainable, lr=3e-3))
    record: dict = {"losses": [], "eval_losses": [], "secondaries_after_eval": 0}
    evaluate_in = CONTEXTS[options["eval_context"]]
    for step in range(options["steps"]):
        if step % options["eval_every"] == 0:
            with evaluate_in():
                tokens = batch_for(-1, fabric.global_rank)
                record["eval_losses"].append(model(input_ids=tokens, labels=tokens).loss.item())
            record["secondaries_after_eval"] = max(record["secondaries_after_eval"], count_secondary_partitions(model))
        tokens = batch_for(step, fabric.global_rank)
        loss = model(input_ids=tokens, labels=tokens).loss
        fabric.backward(loss, model=model)
        optimizer.step()
        optimizer.zero_grad()
        record["losses"].append(loss.item())
    strategy.teardown()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(record))
    fabric.barrier()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
