"""Pure decision logic of :class:`~lightning_hpz.callbacks.LossStabilityMonitor`: detectors and actions, no Trainer.

Every function here is deterministic in its inputs. The callback feeds it values that are identical on every rank
(the loss averaged over ranks, the engine's global gradient norm), so every rank reaches the same decision.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

ACTIONS = ("warn", "stop", "skip", "rollback")
NONFINITE_LOSS, LOSS_SPIKE, GRAD_NORM_SPIKE, DIVERGENCE = (
    "nonfinite_loss",
    "loss_spike",
    "grad_norm_spike",
    "divergence",
)


@dataclass(frozen=True)
class StabilityThresholds:
    """When a value counts as abnormal.

    Attributes:
        window: how many recent normal values the running mean and deviation are taken over.
        warmup: values needed before spikes are judged (the starting level is their mean).
        z_threshold: a loss this many deviations above the running mean is a spike.
        patience: consecutive spiky losses before the spike is acted on.
        grad_z_threshold: the same for the global gradient norm.
        min_relative_std: floor of the deviation as a fraction of the mean, so a flat series does not make every
            wiggle a spike.
        divergence_steps: consecutive losses above the starting level that count as divergence (0 turns it off).
        divergence_margin: a loss is above the starting level when it exceeds it by this fraction.
    """

    window: int = 50
    warmup: int = 10
    z_threshold: float = 6.0
    patience: int = 1
    grad_z_threshold: float = 6.0
    min_relative_std: float = 0.01
    divergence_steps: int = 20
    divergence_margin: float = 0.0

    def __post_init__(self) -> None:
        if self.window < 2 or self.warmup < 2 or self.warmup > self.window:
            raise ValueError(f"Need 2 <= warmup <= window, got warmup={self.warmup}, window={self.window}.")
        if self.z_threshold <= 0 or self.grad_z_threshold <= 0 or self.patience < 1:
            raise ValueError("z thresholds must be positive and patience >= 1.")
        if self.divergence_steps < 0 or self.divergence_margin < 0:
            raise ValueError("divergence_steps and divergence_margin must be >= 0.")


@dataclass(frozen=True)
class StabilityEvent:
    """One detection: what, at which optimizer step, the value and its z-score (when there is one)."""

    kind: str
    step: int
    value: float
    zscore: Optional[float] = None


def _detect_nonfinite(value: float) -> bool:
    return not math.isfinite(value)


def _mean_and_deviation(values: Sequence[float]) -> tuple[float, float]:
    mean = math.fsum(values) / len(values)
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))


def _floored_spread(values: Sequence[float], min_relative_std: float) -> tuple[float, float]:
    """The mean of ``values`` and their deviation, floored (see thresholds) so a flat series has a usable scale."""
    mean, deviation = _mean_and_deviation(values)
    return mean, max(deviation, min_relative_std * abs(mean), 1e-12)


def _zscore(history: Sequence[float], value: float, min_relative_std: float) -> float:
    """How many deviations ``value`` lies above the mean of ``history`` (deviation floored, see thresholds)."""
    mean, deviation = _floored_spread(history, min_relative_std)
    return (value - mean) / deviation


def _detect_spike(history: Sequence[float], value: float, warmup: int, threshold: float, floor: float) -> float:
    """The z-score of ``value`` against ``history``; 0.0 while fewer than ``warmup`` values are known."""
    if len(history) < warmup:
        return 0.0
    return _zscore(history, value, floor)


def _detect_divergence(start_level: Optional[float], value: float, margin: float) -> bool:
    """Whether ``value`` lies above the starting level (by more than ``margin`` of it)."""
    return start_level is not None and value > start_level + margin * abs(start_level)


@dataclass
class SeriesTracker:
    """Running statistics of one monitored series (normal values only, spikes are kept out)."""

    window: int
    history: deque = field(init=False)
    reference: Optional[tuple] = None
    spiky_in_a_row: int = 0
    max_zscore: float = 0.0

    def __post_init__(self) -> None:
        self.history = deque(maxlen=self.window)

    def judged_against(self) -> Sequence[float]:
        """The values a new one is judged against: the frozen reference when there is one, else the live history."""
        return self.history if self.reference is None else self.reference

    def spike_limit(self, warmup: int, threshold: float, floor: float) -> float:
        """The smallest value above which a new one is a spike (``inf`` until ``warmup`` values are known)."""
        values = self.judged_against()
        if len(values) < warmup:
            return math.inf
        mean, deviation = _floored_spread(values, floor)
        return mean + threshold * deviation


@dataclass
class StabilityState:
    """All a monitor remembers between steps; ``observe_*`` return the events a value triggers."""

    thresholds: StabilityThresholds = field(default_factory=StabilityThresholds)
    loss: SeriesTracker = field(init=False)
    grad_norm: SeriesTracker = field(init=False)
    start_values: list = field(default_factory=list)
    above_start_in_a_row: int = 0

    def __post_init__(self) -> None:
        self.loss = SeriesTracker(self.thresholds.window)
        self.grad_norm = SeriesTracker(self.thresholds.window)

    @property
    def start_level(self) -> Optional[float]:
        if len(self.start_values) < self.thresholds.warmup:
            return None
        return math.fsum(self.start_values) / len(self.start_values)

    def observe_loss(self, step: int, value: float, spiky: Optional[bool] = None) -> list[StabilityEvent]:
        """The events ``value`` triggers. ``spiky``, when given, is the verdict already taken on the device against
        :meth:`loss_limit` (it wins over the z-score recomputed here, which could round the other way at the limit)."""
        if _detect_nonfinite(value):
            return [StabilityEvent(NONFINITE_LOSS, step, value)]
        t = self.thresholds
        events = self._observe(self.loss, step, value, LOSS_SPIKE, t.z_threshold, spiky)
        if len(self.start_values) < t.warmup:
            self.start_values.append(value)
        if t.divergence_steps and _detect_divergence(self.start_level, value, t.divergence_margin):
            self.above_start_in_a_row += 1
            if self.above_start_in_a_row >= t.divergence_steps:
                events.append(StabilityEvent(DIVERGENCE, step, value))
                self.above_start_in_a_row = 0
        else:
            self.above_start_in_a_row = 0
        return events

    def observe_grad_norm(self, step: int, value: float) -> list[StabilityEvent]:
        if _detect_nonfinite(value):
            return []  # the loss detector or the engine's overflow guard has dealt with this step already
        return self._observe(self.grad_norm, step, value, GRAD_NORM_SPIKE, self.thresholds.grad_z_threshold)

    def loss_limit(self) -> float:
        """The loss above which a new one is a spike, for judging on the device (see :meth:`freeze`)."""
        t = self.thresholds
        return self.loss.spike_limit(t.warmup, t.z_threshold, t.min_relative_std)

    def freeze(self) -> None:
        """Judge the next values against the statistics as they are now, until the next ``freeze``.

        A monitor that reads its device values every few steps judges each loss against the statistics of the last
        read on the device; the host replays the same values against the same frozen statistics, so both agree.
        """
        for series in (self.loss, self.grad_norm):
            series.reference = tuple(series.history)

    def _observe(
        self,
        series: SeriesTracker,
        step: int,
        value: float,
        kind: str,
        threshold: float,
        spiky: Optional[bool] = None,
    ) -> list[StabilityEvent]:
        t = self.thresholds
        z = _detect_spike(series.judged_against(), value, t.warmup, threshold, t.min_relative_std)
        series.max_zscore = max(series.max_zscore, z)
        if not (z > threshold if spiky is None else spiky):
            series.spiky_in_a_row = 0
            series.history.append(value)
            return []
        series.spiky_in_a_row += 1
        if series.spiky_in_a_row < t.patience:
            return []
        return [StabilityEvent(kind, step, value, z)]

    def forget_recent(self) -> None:
        """After a rollback the weights are older than the recent values: restart the spike counters."""
        self.loss.spiky_in_a_row = self.grad_norm.spiky_in_a_row = 0
        self.above_start_in_a_row = 0


@dataclass(frozen=True)
class StabilityDecision:
    """What to do about this step's events: ``skip_update`` drops the optimizer update of the step (only possible
    before it is applied); ``rollback`` restores the last good checkpoint; ``stop`` saves a checkpoint and ends."""

    skip_update: bool = False
    rollback: bool = False
    stop: bool = False
    warn: bool = False

    @property
    def acts(self) -> bool:
        return self.skip_update or self.rollback or self.stop


def _decide(events: Sequence[StabilityEvent], action: str, rollbacks_left: int) -> StabilityDecision:
    """The response to ``events`` under ``action`` (see :data:`ACTIONS`).

    ``skip`` can only drop an update that has not been applied: a gradient-norm spike (known after the update) or a
    divergence (many updates long) is warned about instead. ``rollback`` also drops the offending update, then
    restores; once ``rollbacks_left`` is spent it stops instead, so a run that keeps failing does not loop.
    """
    if action not in ACTIONS:
        raise ValueError(f"action={action!r} is not one of {ACTIONS}.")
    if not events:
        return StabilityDecision()
    before_update = any(e.kind in (NONFINITE_LOSS, LOSS_SPIKE) for e in events)
    if action == "warn":
        return StabilityDecision(warn=True)
    if action == "stop":
        return StabilityDecision(skip_update=before_update, stop=True, warn=True)
    if action == "skip":
        return StabilityDecision(skip_update=before_update, warn=not before_update)
    if rollbacks_left <= 0:
        return StabilityDecision(skip_update=before_update, stop=True, warn=True)
    return StabilityDecision(skip_update=before_update, rollback=True)
