"""Writes into a ZeRO-3 model between ``fabric.init_module()`` and ``fabric.setup`` reach its shards.

Run as ``python zero3_placeholder_writes.py '<json options>'`` under torchrun (or the suite's warm launcher), 2 CPU
processes. A tiny LitGPT model is built under ``fabric.init_module()`` (``zero.Init``: every parameter an empty
placeholder), then written to the ways scripts for other strategies write to it: LitGPT's own ``initialize_weights``,
a ``load_state_dict`` of a whole state dict, and a read of ``.data``. Rank 0 writes ``rank0.json``: the parameter count
the model reports, the standard deviation of every gathered parameter after ``initialize_weights`` (with the values
LitGPT's rule gives them), whether the loaded weights arrived exactly, and the warnings seen.
"""

import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import json
import math
import sys
import warnings
from pathlib import Path

import deepspeed
import lightning as L
import torch
from litgpt.config import Config
from litgpt.model import GPT
from litgpt.pretrain import initialize_weights

import lightning_hpz

CONFIG = Config(name="tiny", n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=64, padded_vocab_size=64)


def litgpt_std(name: str) -> float:
    """The standard deviation LitGPT's ``initialize_weights`` draws a parameter from (0 for the constant ones)."""
    if not name.endswith("weight") or "norm" in name or "ln_f" in name:
        return 0.0
    if name.endswith("attn.proj.weight"):
        return 1 / math.sqrt(CONFIG.n_embd) / CONFIG.n_layer
    return math.sqrt(2.0 / 5 / CONFIG.n_embd)


def gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: param.detach().clone() for name, param in params.items()}


def main(options: dict) -> None:
    fabric = L.Fabric(strategy=lightning_hpz.HpzFabricStrategy(stage=3), accelerator="cpu", devices=2)
    fabric.launch()
    fabric.seed_everything(0)
    with fabric.init_module(empty_init=True):
        model = GPT(CONFIG)
        loaded = GPT(CONFIG)
    record = {"count": sum(p.numel() for p in model.parameters()), "expected_count": 0}
    record["expected_count"] = sum(p.numel() for p in GPT(CONFIG).parameters())
    initialize_weights(fabric, model, n_layer=CONFIG.n_layer, n_embd=CONFIG.n_embd)
    reference = GPT(CONFIG).state_dict()  # the same on every rank: all draw after the same seed and calls
    loaded.load_state_dict(reference)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _ = model.lm_head.weight.data
    record["warnings"] = [type(warning.message).__name__ for warning in seen]
    fabric.setup(model)
    fabric.setup(loaded)  # the closing of the window set-up makes; each gets an inference engine at its first use
    record["stds"] = {name: [value.std().item(), litgpt_std(name)] for name, value in gathered(model).items()}
    record["loaded_exactly"] = all(torch.equal(value, reference[name]) for name, value in gathered(loaded).items())
    if fabric.global_rank == 0:
        out = Path(options["out"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "rank0.json").write_text(json.dumps(record))
    fabric.strategy.teardown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
