"""AdamW parameter groups and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from torch import nn

from lightning_hpz.models.sharded_weights import full_shape


def weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two AdamW groups: matrices decay; norms, biases and embeddings do not (decaying them only hurts).

    Shapes are read with :func:`full_shape`, since a ZeRO-3 partitioned parameter's own tensor is empty.
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay, seen = [], [], set()
    for param in model.parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        exempt = len(full_shape(param)) < 2 or id(param) in embeddings
        (no_decay if exempt else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def warmup_cosine(warmup_steps: int, total_steps: float, min_ratio: float = 0.1) -> Callable[[int], float]:
    """Multiplier of the peak learning rate at each step: linear warmup, then cosine decay to ``min_ratio``.

    With an unknown total (``inf``, training by time or without a step limit) it stays at the peak after warmup.
    """

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if math.isinf(total_steps) or total_steps <= warmup_steps:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return multiplier
