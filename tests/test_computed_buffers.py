"""Buffers computed again in float32 after a ZeRO-3 build (one process; the layouts are in test_initial_weights.py)."""

import pytest
import torch
from torch import nn

from lightning_hpz.models import Falcon, Llama2
from lightning_hpz.models.computed_buffers import recompute_buffers_in_float32


def _built(model_class: type, preset: str) -> nn.Module:
    module = model_class(preset=preset)
    module.configure_model()
    return module.model


def _lowered_as_zero_init_does(model: nn.Module) -> None:
    """What zero.Init leaves under bf16: every floating buffer in bf16 (there, computed in bf16 too)."""
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_floating_point():
                setattr(module, name, buffer.bfloat16())


@pytest.mark.parametrize(("model_class", "preset"), [(Llama2, "llama2-tiny"), (Falcon, "falcon-tiny")])
def test_rotary_frequencies_come_back_as_a_float32_build_has_them(model_class, preset):
    model = _built(model_class, preset)
    reference = {name: buffer.clone() for name, buffer in model.named_buffers()}
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    _lowered_as_zero_init_does(model)
    recomputed = recompute_buffers_in_float32(model)
    assert sorted(recomputed) == sorted(reference) and any(name.endswith("rotary_emb.inv_freq") for name in recomputed)
    for name, buffer in model.named_buffers():
        assert buffer.dtype == torch.float32 and torch.equal(buffer, reference[name]), name
    assert all(torch.equal(p, weights[name]) for name, p in model.named_parameters())  # no weight drawn again


def test_float32_model_is_left_alone():
    model = _built(Llama2, "llama2-tiny")
    before = {name: buffer for name, buffer in model.named_buffers()}
    assert recompute_buffers_in_float32(model) == []
    assert all(buffer is before[name] for name, buffer in model.named_buffers())


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((4,), 1 / 3, dtype=torch.bfloat16))


class _OwnInit(nn.Module):
    """A model with an ``_init_weights`` that does not compute ``_Scale``'s buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = _Scale()

    def _init_weights(self, module: nn.Module) -> None:
        pass


class _ComputesScale(_OwnInit):
    """A user's model that computes ``_Scale``'s buffer in ``_init_weights``, as transformers does its rotary ones."""

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, _Scale):
            module.scale.copy_(torch.full((4,), 1 / 3))


def test_buffer_a_users_init_weights_computes_is_computed_in_float32():
    model = _ComputesScale()
    assert recompute_buffers_in_float32(model) == ["scale.scale"]
    assert model.scale.scale.dtype == torch.float32 and torch.equal(model.scale.scale, torch.full((4,), 1 / 3))


@pytest.mark.parametrize("model", [_OwnInit(), nn.Sequential(_Scale())], ids=["not-computed-by-init", "no-init"])
def test_buffer_nobody_computes_keeps_its_dtype_and_values(model):
    scale = model.get_submodule("scale" if isinstance(model, _OwnInit) else "0").scale
    assert recompute_buffers_in_float32(model) == []
    (buffer,) = model.buffers()
    assert buffer is scale and buffer.dtype == torch.bfloat16
