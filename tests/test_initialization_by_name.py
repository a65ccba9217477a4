"""Initial weights drawn by module name (one process; the multi-process layouts are in test_initial_weights.py)."""

import torch
from torch import nn
from transformers import LlamaForCausalLM

from lightning_hpz import initialize_by_name
from lightning_hpz.models import Llama2
from lightning_hpz.models.initialization_by_name import draw_seed


def _weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _init_linear(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        nn.init.zeros_(module.bias)


def _layers(order: list[str]) -> nn.ModuleDict:
    """The same named layers, constructed in ``order`` (each construction draws PyTorch's defaults)."""
    built = {name: nn.Linear(8, 8) for name in order}
    return nn.ModuleDict({name: built[name] for name in sorted(order)})


def test_weights_depend_on_seed_and_names_not_on_construction_order():
    forward, backward = _layers(["a", "b", "c"]), _layers(["c", "b", "a"])
    initialize_by_name(forward, _init_linear, seed=7)
    torch.randn(100)  # the generator's state plays no part either
    initialize_by_name(backward, _init_linear, seed=7)
    assert _same(_weights(forward), _weights(backward))
    assert forward["a"].weight.std().item() < 0.05  # drawn by init_fn, not PyTorch's default (std 0.2 here)
    initialize_by_name(backward, _init_linear, seed=8)
    assert not torch.equal(forward["a"].weight, backward["a"].weight)


def test_default_init_is_the_transformers_models_own():
    torch.manual_seed(0)
    module = Llama2(preset="llama2-tiny")
    module.configure_model()
    std = module.hf_config.initializer_range
    assert abs(module.model.lm_head.weight.std().item() - std) < 0.1 * std
    assert torch.equal(module.model.model.norm.weight, torch.ones_like(module.model.model.norm.weight))


def test_turned_off_keeps_transformers_own_draws():
    torch.manual_seed(0)
    module = Llama2(preset="llama2-tiny", layout_independent_init=False)
    module.configure_model()
    torch.manual_seed(0)
    bare = LlamaForCausalLM(module.hf_config)
    assert _same(_weights(module.model), _weights(bare))
    torch.manual_seed(0)
    by_name = Llama2(preset="llama2-tiny")
    by_name.configure_model()
    assert not _same(_weights(module.model), _weights(by_name.model))


def test_seed_is_drawn_on_the_cpu_whatever_the_default_device():
    # Under ZeRO-1/2 on a GPU, Lightning runs configure_model inside torch.device("cuda"); under zero.Init there is no
    # device context. A seed drawn on the default device came from the CUDA generator in one case and the CPU one in
    # the other (seen on an H200). "meta" stands in for "cuda" here: it draws nothing, so only a CPU draw works.
    torch.manual_seed(11)
    plain = draw_seed()
    torch.manual_seed(11)
    with torch.device("meta"):
        inside_a_device_context = draw_seed()
    assert inside_a_device_context == plain
