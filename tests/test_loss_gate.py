"""The device-side loss verdict (``LossGate``) against the host detectors it stands in for, without a Trainer.

The monitor judges each loss on the device against statistics frozen at its last host read, then replays the
verdicts on the host. Read every value, that must be exactly the host detectors' own judgement; read every few
values, a spike must still be caught and dropped when it arrives, not when the host next looks.
"""

import math

import pytest
import torch
from test_callbacks_stability_detection import noisy_decay

from lightning_hpz.callbacks.loss_gate import LossGate
from lightning_hpz.callbacks.stability_detection import LOSS_SPIKE, NONFINITE_LOSS, StabilityState, StabilityThresholds


def host_only(series, thresholds):
    state = StabilityState(thresholds)
    return [(e.kind, e.step) for step, value in enumerate(series) for e in state.observe_loss(step, value)]


def gated(series, thresholds, read_every, action="skip"):
    """The monitor's loop: device verdicts, replayed on the host every ``read_every`` values."""
    state, gate = StabilityState(thresholds), LossGate(thresholds.patience, drops_updates=action != "warn")
    pending, events, dropped = [], [], []
    for step, value in enumerate(series):
        verdict = gate.judge(torch.tensor(value, dtype=torch.float32), listed=False)
        pending.append((step, value, verdict))
        if (step + 1) % read_every == 0 or step == len(series) - 1:
            for past, loss, v in pending:
                events += [(e.kind, e.step) for e in state.observe_loss(past, loss, spiky=bool(v.spiky))]
                if bool(v.drop):
                    assert math.isnan(float(v.gradient_factor))
                    dropped.append(past)
                else:
                    assert float(v.gradient_factor) == 1.0
            pending.clear()
            state.freeze()
            gate.set_limit(state.loss_limit())
    return events, dropped


def spiky_series(seed):
    series = noisy_decay(400, seed=seed)
    for step in (150, 260, 261):
        series[step] += 2.0
    series[300] = math.nan
    return series


@pytest.mark.parametrize("patience", [1, 2])
@pytest.mark.parametrize("seed", range(3))
def test_read_every_value_the_gate_judges_exactly_as_the_host(seed, patience):
    series, thresholds = spiky_series(seed), StabilityThresholds(patience=patience)
    events, dropped = gated(series, thresholds, read_every=1)
    assert events == host_only(series, thresholds)
    assert dropped == [step for _, step in events]  # every acted-on loss, and only those, dropped its update


def test_read_every_few_steps_a_spike_is_still_dropped_when_it_arrives():
    series = spiky_series(seed=0)
    events, dropped = gated(series, StabilityThresholds(), read_every=7)
    assert events == [(LOSS_SPIKE, 150), (LOSS_SPIKE, 260), (LOSS_SPIKE, 261), (NONFINITE_LOSS, 300)]
    assert dropped == [150, 260, 261, 300]


def test_warn_drops_nothing_and_the_warmup_judges_nothing():
    series = spiky_series(seed=1)
    events, dropped = gated(series, StabilityThresholds(), read_every=5, action="warn")
    assert (LOSS_SPIKE, 150) in events and dropped == []
    state = StabilityState(StabilityThresholds(warmup=10))
    assert state.loss_limit() == math.inf  # nothing is a spike before the statistics exist


def test_a_listed_batch_is_dropped_whatever_its_loss():
    gate = LossGate(patience=1, drops_updates=False)
    verdict = gate.judge(torch.tensor(1.0), listed=True)
    assert bool(verdict.drop) and not bool(verdict.spiky) and math.isnan(float(verdict.gradient_factor))
