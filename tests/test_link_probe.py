"""The link probe's sizing and timing rules (units; the real probe: test_autotune_training, test_plan_probe)."""

from __future__ import annotations

import itertools

import pytest

from lightning_hpz.autotune import link_probe
from lightning_hpz.autotune.link_probe import MAX_BYTES, PAGE_BYTES, TARGET_SECONDS, _Link


@pytest.mark.parametrize(
    ("size", "seconds", "expected"),
    [
        (8 * 2**20, TARGET_SECONDS / 2, 16 * 2**20),  # half the target: twice the bytes
        (8 * 2**20, TARGET_SECONDS * 0.6, int(8 * 2**20 / 0.6) // PAGE_BYTES * PAGE_BYTES),
        (MAX_BYTES, 0.01, MAX_BYTES),  # never past the cap
        (256 * 1024, 1.0, 256 * 1024),  # a link slower than the target: never below the measured size
    ],
)
def test_the_repeated_message_is_scaled_to_take_the_target_time(size, seconds, expected):
    scaled = link_probe._sized_for_target(size, seconds)
    assert scaled == expected and scaled % PAGE_BYTES == 0


def test_repeats_alternate_between_the_kinds_and_each_keeps_its_fastest(monkeypatch):
    calls = []
    times = {"inter": iter([0.30, 0.20, 0.25, 0.40, 0.22]), "intra": iter([0.05, 0.09, 0.04, 0.06, 0.07])}

    def agreed(group, size, buffers=None):
        calls.append(group)
        return next(times[group])

    monkeypatch.setattr(link_probe, "_agreed_seconds", agreed)
    inter = _Link("inter", group_size=2, latency=1e-3, size=1000, buffers=(None, None))
    intra = _Link("intra", group_size=4, latency=1e-4, size=3000, buffers=(None, None))
    link_probe._time_alternately([inter, intra])
    assert calls == list(itertools.chain.from_iterable(["inter", "intra"] for _ in range(link_probe.REPEATS)))
    assert inter.seconds == 0.20 and intra.seconds == 0.04
    assert inter.rate == pytest.approx(1 * 1000 / 0.20)  # what one rank sent: (group size - 1) pieces
    assert intra.rate == pytest.approx(3 * 3000 / 0.04)
