"""The stability detectors and the decision logic on synthetic loss series, without a Trainer."""

import math

import pytest
import torch

from lightning_hpz.callbacks.stability_detection import (
    DIVERGENCE,
    GRAD_NORM_SPIKE,
    LOSS_SPIKE,
    NONFINITE_LOSS,
    StabilityEvent,
    StabilityState,
    StabilityThresholds,
    _decide,
    _zscore,
)


def noisy_decay(steps: int, seed: int, noise: float = 0.05) -> list[float]:
    """A clean training curve: exponential decay towards 2.0 with Gaussian noise."""
    generator = torch.Generator().manual_seed(seed)
    t = torch.arange(steps, dtype=torch.float64)
    curve = 2.0 + 3.0 * torch.exp(-t / 150) + noise * torch.randn(steps, generator=generator, dtype=torch.float64)
    return curve.tolist()


def run(series: list[float], thresholds: StabilityThresholds | None = None) -> list[StabilityEvent]:
    state = StabilityState(thresholds or StabilityThresholds())
    return [event for step, value in enumerate(series) for event in state.observe_loss(step, value)]


@pytest.mark.parametrize("seed", range(5))
def test_clean_noisy_series_raises_no_alarm(seed):
    assert run(noisy_decay(2000, seed)) == []


def test_spike_is_found_at_its_step_with_its_zscore():
    series = noisy_decay(300, seed=1)
    series[200] += 2.0  # 40 noise deviations
    events = run(series)
    assert [(e.kind, e.step) for e in events] == [(LOSS_SPIKE, 200)]
    assert events[0].zscore > 6


def test_spike_stays_out_of_the_running_statistics():
    series = noisy_decay(300, seed=2)
    series[200] += 2.0
    series[201] += 2.0
    assert [e.step for e in run(series)] == [200, 201]  # had 200 entered the window, 201 would look normal


def test_patience_needs_consecutive_spikes():
    series = noisy_decay(300, seed=3)
    series[100] += 2.0  # alone: below patience
    series[200] += 2.0
    series[201] += 2.0
    events = run(series, StabilityThresholds(patience=2))
    assert [e.step for e in events] == [201]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_loss_is_reported_at_once(bad):
    series = noisy_decay(50, seed=4)
    series[3] = bad  # before warmup ends: no statistics needed
    events = run(series)
    assert [(e.kind, e.step) for e in events] == [(NONFINITE_LOSS, 3)]


def test_slow_divergence_is_found_after_its_patience():
    series = noisy_decay(200, seed=5)
    start = sum(series[:10]) / 10
    rising = [series[-1] + 0.02 * i for i in range(400)]  # a slow climb, never a spike
    thresholds = StabilityThresholds(divergence_steps=20)
    events = run(series + rising, thresholds)
    assert {e.kind for e in events} == {DIVERGENCE}
    first = events[0].step
    crossing = next(i for i, v in enumerate(series + rising) if i >= 10 and v > start)
    assert first == crossing + thresholds.divergence_steps - 1


def test_grad_norm_spike():
    state = StabilityState()
    norms = [1.0 + 0.01 * math.sin(i) for i in range(30)] + [5.0]
    events = [e for step, n in enumerate(norms) for e in state.observe_grad_norm(step, n)]
    assert [(e.kind, e.step) for e in events] == [(GRAD_NORM_SPIKE, 30)]


def test_flat_series_does_not_turn_wiggles_into_spikes():
    # Deviation 0 would make any change infinitely many deviations; the relative floor prevents that.
    assert math.isclose(_zscore([2.0] * 20, 2.01, 0.01), 0.5)


def test_decisions_per_action():
    spike, late = [StabilityEvent(LOSS_SPIKE, 3, 9.0, 7.0)], [StabilityEvent(GRAD_NORM_SPIKE, 3, 9.0, 7.0)]
    assert _decide([], "rollback", 3).acts is False
    assert _decide(spike, "warn", 3).acts is False
    assert _decide(spike, "skip", 3).skip_update
    assert not _decide(late, "skip", 3).skip_update  # the update is already applied: warn
    assert _decide(late, "skip", 3).warn
    stop = _decide(spike, "stop", 3)
    assert stop.stop and stop.skip_update
    rollback = _decide(late, "rollback", 3)
    assert rollback.rollback and not rollback.skip_update
    exhausted = _decide(spike, "rollback", 0)
    assert exhausted.stop and not exhausted.rollback


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="warmup"):
        StabilityThresholds(window=5, warmup=10)
    with pytest.raises(ValueError, match="action"):
        _decide([StabilityEvent(LOSS_SPIKE, 0, 1.0)], "explode", 1)
