"""The planner's model of the ZeRO-3 thresholds against what DeepSpeed does: the share of the model released after
forward (and gathered again in backward) under each retention profile the autotuner offers (2 CPU ranks, hpZ 2)."""

from __future__ import annotations

import pytest
from conftest import run_script

from lightning_hpz.planning.tuning import retained_fraction

PARAMETERS = 8 * (64 * 64 + 64)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("retention") / "out"
    run = run_script("retention_semantics.py", {}, out, timeout=300, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    assert sorted(run.ranks) == [0, 1], run.output[-4000:]
    return run.ranks


@pytest.mark.parametrize("profile", ["release", "half", "keep"])
def test_released_share_matches_the_planners_prediction(ranks, profile):
    for rank in (0, 1):
        record = ranks[rank][profile]
        predicted_released = 1.0 - retained_fraction(record["thresholds"], PARAMETERS)
        measured = record["released_share"][-1]  # step 3: DeepSpeed decides from the trace of step 1
        assert measured == pytest.approx(predicted_released, abs=0.15), (profile, record)


def test_the_profiles_really_differ(ranks):
    shares = [ranks[0][profile]["released_share"][-1] for profile in ("release", "half", "keep")]
    assert shares[0] > shares[1] > shares[2]
