"""Gradient clipping by global norm for one DeepSpeed step, asked for by the training loop (``fabric.clip_gradients``).

Under ZeRO the gradient a clip must see exists only inside the step: stage 1 reduces it there, stages 2 and 3 hold
it in shards spread over the ranks, in the ZeRO optimizer's own buffers (on the CPU when offloaded). DeepSpeed
computes the global norm over those shards and clips by it inside ``DeepSpeedEngine.step()``, with the threshold in
the ZeRO optimizer's ``clip_grad`` (set from the config's ``gradient_clipping``). So a clip the loop asks for is
that threshold, set for the next step alone, and the norm is the one DeepSpeed computed in that step
(``engine.get_global_grad_norm()``, before clipping, like ``torch.nn.utils.clip_grad_norm_``'s return value).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_hpz.partitioning.deepspeed_patch import IncompatibleDeepSpeedError

# the ZeRO optimizers' threshold attribute (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3, BF16_Optimizer;
# DeepSpeed 0.16 to 0.19)
THRESHOLD = "clip_grad"


def clipping_optimizer(engine: Any) -> Any:
    """The optimizer inside ``engine`` that clips in its step, or a clear error when there is none."""
    optimizer = getattr(engine, "optimizer", None)
    if not hasattr(optimizer, THRESHOLD):
        raise IncompatibleDeepSpeedError(
            f"DeepSpeed's {type(optimizer).__name__} has no `{THRESHOLD}`, so `fabric.clip_gradients` cannot clip "
            "inside its step (ZeRO stage 0 with fp32 clips only from the config). Set `gradient_clipping` in the "
            "DeepSpeed config instead, or use ZeRO stage 1, 2 or 3."
        )
    if getattr(optimizer, "compute_grad_norm", True) is False:
        raise ValueError(
            "`fabric.clip_gradients` needs the gradient norm, which `zero_optimization.compute_grad_norm: false` turns "
            "off. Remove that setting or do not clip."
        )
    return optimizer


@contextmanager
def clipped_step(engine: Any, max_norm: float) -> Iterator[None]:
    """Clip by ``max_norm`` in the step run inside this context; the configured threshold is back afterwards."""
    optimizer = clipping_optimizer(engine)
    configured = getattr(optimizer, THRESHOLD)
    setattr(optimizer, THRESHOLD, float(max_norm))
    try:
        yield
    finally:
        setattr(optimizer, THRESHOLD, configured)


def write_step_norm(engine: Any, into: torch.Tensor) -> None:
    """Copy the global gradient norm of the step just taken into ``into`` (stays on the device: no host stall)."""
    norm = engine.get_global_grad_norm()
    if norm is None:  # the engine computed none (compute_grad_norm off, which clipped_step refuses)
        into.fill_(float("nan"))
    elif isinstance(norm, torch.Tensor):
        into.copy_(norm.detach().reshape(()))
    else:
        into.fill_(float(norm))
