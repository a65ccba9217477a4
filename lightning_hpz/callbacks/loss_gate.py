"""``LossGate``: the loss-spike and non-finite-loss verdict of ``LossStabilityMonitor``, taken on the loss's device.

Reading a loss on the host (``float(loss)``) waits for the whole forward pass and drains the GPU pipeline; done per
micro-batch it costs every step. The gate compares the loss with a limit the host computed at its last read (see
:meth:`~lightning_hpz.callbacks.stability_detection.StabilityState.loss_limit`) and counts spiky losses in a row,
all with tensor operations, so the verdict and the gradient factor that drops an update never leave the device. The
host reads the verdicts later, in one batch, and replays them through the same detection logic for its report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossVerdict:
    """One micro-batch's verdict, as 0-dim device tensors: ``spiky`` (finite and above the limit), ``drop`` (its
    update must be dropped) and ``gradient_factor`` (1.0, or NaN to make the engine's overflow guard drop it)."""

    spiky: torch.Tensor
    drop: torch.Tensor
    gradient_factor: torch.Tensor


class LossGate:
    """Judges each loss on its device against the limit set by the host; see the module docstring.

    Args:
        patience: spiky losses in a row before one is acted on.
        drops_updates: whether an acted-on loss drops its update (every action but ``"warn"``).
    """

    def __init__(self, patience: int, drops_updates: bool) -> None:
        self.patience = patience
        self.drops_updates = drops_updates
        self._limit = math.inf
        self._limit_tensor: torch.Tensor | None = None
        self._spiky_in_a_row: torch.Tensor | None = None

    @property
    def armed(self) -> bool:
        """Whether a limit is set: until the host has seen enough losses, no finite loss can be judged spiky."""
        return math.isfinite(self._limit)

    def set_limit(self, limit: float) -> None:
        """The loss above which a finite loss is spiky, from now on (``inf`` while the statistics warm up)."""
        self._limit = limit
        if self._limit_tensor is not None:
            self._limit_tensor.fill_(limit)  # a host-to-device copy, queued: the host does not wait

    def set_spiky_in_a_row(self, count: int) -> None:
        """Agree with the host's count (after a rollback it restarts at 0)."""
        if self._spiky_in_a_row is not None:
            self._spiky_in_a_row.fill_(count)

    def judge(self, loss: torch.Tensor, listed: bool) -> LossVerdict:
        """The verdict on ``loss`` (a 0-dim tensor, equal on every rank); ``listed``: the batch is on the skip list."""
        self._place(loss.device)
        finite = torch.isfinite(loss)
        spiky = finite & (loss > self._limit_tensor)
        in_a_row = torch.where(spiky, self._spiky_in_a_row + 1, torch.where(finite, 0, self._spiky_in_a_row))
        self._spiky_in_a_row.copy_(in_a_row)
        acted_on = ~finite | (in_a_row >= self.patience)
        drop = (acted_on & self.drops_updates) | listed
        factor = torch.where(drop, torch.full_like(loss, math.nan), torch.ones_like(loss))
        return LossVerdict(spiky=spiky, drop=drop, gradient_factor=factor)

    def _place(self, device: torch.device) -> None:
        if self._limit_tensor is None or self._limit_tensor.device != device:
            count = 0 if self._spiky_in_a_row is None else self._spiky_in_a_row.to(device)
            self._limit_tensor = torch.full((), self._limit, dtype=torch.float32, device=device)
            self._spiky_in_a_row = torch.zeros((), dtype=torch.int64, device=device) + count
