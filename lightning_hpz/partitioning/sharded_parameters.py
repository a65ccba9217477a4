"""Sizes and shapes of parameters that ZeRO-3 may have partitioned (DeepSpeed's ``ds_*`` attributes, read here only).

Under ZeRO-3 (``zero.Init``) a parameter holds an empty tensor on every rank and its shard in ``ds_tensor``; under
ZeRO-1/2 or without DeepSpeed it is an ordinary tensor. These helpers treat both alike.
"""

from __future__ import annotations

import torch
from torch import nn


def is_partitioned(param: torch.Tensor) -> bool:
    """Whether ``param`` is a ZeRO-3 partitioned parameter."""
    return hasattr(param, "ds_id")


def full_shape(param: torch.Tensor) -> torch.Size:
    """The shape of the whole parameter, also while only a shard of it is on this rank."""
    return torch.Size(getattr(param, "ds_shape", param.shape))


def local_element_count(module: nn.Module) -> int:
    """Parameter elements held in this rank's memory: the shard under ZeRO-3, everything otherwise."""
    return sum(p.ds_tensor.numel() if is_partitioned(p) else p.numel() for p in module.parameters())


def full_element_count(module: nn.Module) -> int:
    """Parameter elements of the whole model, counted from the shapes (nothing is gathered)."""
    return sum(full_shape(p).numel() for p in module.parameters())
