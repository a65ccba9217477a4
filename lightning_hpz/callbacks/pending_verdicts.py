"""What ``LossStabilityMonitor`` keeps on the device between host reads, and the one read that brings it over.

Each micro-batch leaves a :class:`PendingLoss` (its loss averaged over ranks and the device verdict on it), each
optimizer step a :class:`PendingStep` (whether the engine applied it, and its gradient norm as the engine holds it,
possibly a device tensor). :func:`read_pending` copies all their device values to the host in one transfer, so the
monitor waits for the device once per read instead of once per value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from lightning_hpz.callbacks.loss_gate import LossVerdict


@dataclass(frozen=True)
class PendingLoss:
    step: int
    batch_key: tuple[int, int]
    loss: torch.Tensor
    verdict: LossVerdict


@dataclass(frozen=True)
class PendingStep:
    step: int
    applied: bool
    grad_norm: Any  # a float, a 0-dim tensor or None, as the engine returned it


@dataclass(frozen=True)
class ReadLoss:
    step: int
    batch_key: tuple[int, int]
    loss: float
    spiky: bool
    drop: bool


@dataclass(frozen=True)
class ReadStep:
    step: int
    applied: bool
    grad_norm: Optional[float]


def read_pending(records: list[Union[PendingLoss, PendingStep]]) -> list[Union[ReadLoss, ReadStep]]:
    """The records with host values, in their order; one device-to-host transfer for all of them."""
    tensors = [t for record in records for t in _device_values(record)]
    values = iter(_to_host(tensors))
    read: list[Union[ReadLoss, ReadStep]] = []
    for record in records:
        if isinstance(record, PendingLoss):
            loss, spiky, drop = next(values), next(values), next(values)
            read.append(ReadLoss(record.step, record.batch_key, loss, bool(spiky), bool(drop)))
        else:
            norm = next(values) if isinstance(record.grad_norm, torch.Tensor) else record.grad_norm
            read.append(ReadStep(record.step, record.applied, None if norm is None else float(norm)))
    return read


def _device_values(record: Union[PendingLoss, PendingStep]) -> list[torch.Tensor]:
    if isinstance(record, PendingLoss):
        return [record.loss, record.verdict.spiky, record.verdict.drop]
    return [record.grad_norm] if isinstance(record.grad_norm, torch.Tensor) else []


def _to_host(tensors: list[torch.Tensor]) -> list[float]:
    if not tensors:
        return []
    device = tensors[0].device  # copies between devices are queued; only the final transfer waits
    stacked = torch.stack([t.detach().reshape(()).to(device=device, dtype=torch.float64) for t in tensors])
    return stacked.tolist()
