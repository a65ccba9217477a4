"""Buffers a model computes in its constructor (rotary frequencies), computed again in float32 after a ZeRO-3 build.

Why this exists: under ``bf16-mixed`` (or ``16-mixed``) ZeRO-1/2 build the model in float32 and DeepSpeed's engine
casts its parameters only (DeepSpeed >= 0.19.2, ``_cast_module_mixed_precision``; before, ``module.bfloat16()`` cast
the float32 buffers as well). Under ZeRO-3, ``zero.Init`` makes every floating tensor a constructor creates in the
training precision (its ``torch.arange``, ``torch.zeros``... wrappers), so a buffer that is computed, not drawn, such as
Llama-2's and Falcon's rotary ``inv_freq``, is computed in bf16: other values, and from bit-identical weights another
loss (Llama-2-tiny: 5.976398 under ZeRO-1, 5.976407 under ZeRO-3). Computing it again inside ``configure_model`` would
round it again (``zero.Init`` is still active there), so the strategy calls :func:`recompute_buffers_in_float32` once
``zero.Init`` has exited, before the engine is built: the engine then finds the same float32 buffers under every stage.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_hpz.models.initialization_by_name import post_order_with_owners


def recompute_buffers_in_float32(model: nn.Module) -> list[str]:
    """Compute again, in float32, the floating buffers that ``model``'s ``_init_weights`` computes; their names.

    The rule is transformers' own: ``PreTrainedModel._init_weights`` (transformers 5) recomputes a rotary embedding's
    ``inv_freq`` and ``original_inv_freq`` from its config. Each module without parameters whose floating buffers are
    not float32 gets float32 buffers, which the ``_init_weights`` of the nearest model above it (as in
    :func:`~lightning_hpz.models.initialize_by_name`) fills; a buffer it does not fill is left as it was. Modules with
    parameters are never passed, so no weight is drawn again. Under float32 training nothing is lowered: a no-op.
    """
    recomputed = []
    for name, module, owner in post_order_with_owners(model):
        lowered = _lowered_buffers(module)
        if owner is None or not lowered or any(True for _ in module.parameters()):
            continue
        prefix = f"{name}." if name else ""
        recomputed += [prefix + buffer for buffer in _recompute(module, owner, lowered)]
    return recomputed


def _lowered_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: buffer
        for name, buffer in module.named_buffers(recurse=False)
        if buffer.is_floating_point() and buffer.dtype != torch.float32
    }


def _recompute(module: nn.Module, owner: nn.Module, lowered: dict[str, torch.Tensor]) -> list[str]:
    # NaN placeholders show which buffers `_init_weights` wrote (transformers copies into the buffer it finds)
    for name, buffer in lowered.items():
        setattr(module, name, torch.full_like(buffer, float("nan"), dtype=torch.float32))
    # on the buffers' device, as a ZeRO-1/2 build computes them inside Lightning's `torch.device` init context
    with torch.no_grad(), torch.device(next(iter(lowered.values())).device):
        owner._init_weights(module)
    written = [name for name in lowered if not getattr(module, name).isnan().any()]
    for name in lowered.keys() - set(written):
        setattr(module, name, lowered[name])
    return written
