"""The hpZ ordering lives from strategy setup to teardown: after fit, and after a fit that raised, DeepSpeed is as
shipped in the same process (its own functions, its own copy synchronize, plain gathers for a new engine)."""

import pytest
from conftest import assert_succeeded, run_script

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def record(module_tmp):
    run = run_script("plain_deepspeed_after_fit.py", {}, module_tmp / "out", timeout=300, ranks=1)
    assert_succeeded(run, ranks=1)
    return run.ranks[0]


@pytest.mark.parametrize("phase", ["after_fit", "after_exception"])
def test_deepspeed_is_as_shipped_after_the_strategy(record, phase):
    assert record[phase]["owners"] == ["deepspeed"]
    # PR #5216's host synchronize after the copy, not the strategy's ordering ("event" recorded an event instead)
    assert (record[phase]["synchronized"], record[phase]["events"]) == (1, 0)


def test_the_failed_fit_really_raised(record):
    assert "deliberate failure on rank 0" in record["raised"]


def test_plain_deepspeed_engine_after_fit_trains_with_its_own_gathers(record):
    assert record["plain"]["losses_finite"]
    assert record["plain"]["ordered_gathers"] == 0
