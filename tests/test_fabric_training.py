"""A custom Fabric loop under ``Fabric(strategy=HpzFabricStrategy(...))`` on 4 CPU processes over gloo.

The promises are the Trainer's (tests/test_race_emulation.py), made again for a loop the user writes: hpZ 2 trains
exactly like hpZ 1; under the emulated asynchronous copy, ``hpz_sync="none"`` breaks that and ``"event"`` keeps it; a
sharded checkpoint saved at step k and loaded into a freshly built model continues exactly as the uninterrupted run.
One launch per mode; each launch saves and resumes inside the same run.
"""

import math

import pytest
from conftest import REGATHER_EVERY_MODULE, assert_succeeded, run_script

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
STEPS, SAVE_AT, CHECK_EVERY, REFRESH_AT = 10, 5, 5, 3
UNORDERED_STEPS = 4


def _train(module_tmp, name: str, strategy: dict, **options):
    strategy = {"stage": 3, "config": REGATHER_EVERY_MODULE, **strategy}
    options = {"steps": STEPS, **options, "strategy": strategy}
    run = run_script("fabric_training.py", options, module_tmp / name, timeout=900, ranks=4)
    assert_succeeded(run)
    return run


def _losses(run, rank: int, key: str = "losses") -> list[float]:
    record = run.ranks[rank][key]
    return [record[step] for step in sorted(record, key=int)]


@pytest.fixture(scope="module")
def plain_zero3(module_tmp):
    return _train(module_tmp, "plain", {"hpz_partition_size": 1}, save_at=SAVE_AT)


@pytest.fixture(scope="module")
def event_ordered(module_tmp):
    strategy = {"hpz_partition_size": 2, "hpz_sync": "event", "emulate_async_copy": True}
    return _train(module_tmp, "event", strategy, save_at=SAVE_AT, check_every=CHECK_EVERY, refresh_at=REFRESH_AT)


def test_hpz2_with_event_ordering_matches_hpz1_exactly(plain_zero3, event_ordered):
    for rank in range(4):
        reference = _losses(plain_zero3, rank)
        assert len(reference) == STEPS and all(math.isfinite(v) for v in reference)
        assert _losses(event_ordered, rank) == reference, f"rank {rank}"
    # hpZ really ran: secondaries existed at every step, and every gather of one waited on its copy's event
    assert min(event_ordered.ranks[0]["secondaries_seen"]) > 0
    assert max(plain_zero3.ranks[0]["secondaries_seen"]) == 0
    ordering = event_ordered.ranks[0]["copy_ordering"]
    assert ordering["host_syncs"] == 0 and ordering["events_waited"] > 0


def test_unordered_copy_breaks_the_loop(module_tmp, plain_zero3):
    strategy = {"hpz_partition_size": 2, "hpz_sync": "none", "emulate_async_copy": True}
    run = _train(module_tmp, "none", strategy, steps=UNORDERED_STEPS)  # it breaks from the first step on
    losses = _losses(run, 0)
    assert len(losses) == UNORDERED_STEPS and losses != _losses(plain_zero3, 0)[:UNORDERED_STEPS]
    assert any(math.isnan(v) for v in losses), losses
    assert run.ranks[0]["copy_ordering"]["events_recorded"] == 0


@pytest.mark.parametrize("mode", ["plain_zero3", "event_ordered"])
def test_load_at_step_k_continues_like_the_uninterrupted_run(request, mode):
    run = request.getfixturevalue(mode)
    for rank in range(4):
        assert run.ranks[rank]["loaded_step"] == SAVE_AT
        assert _losses(run, rank, "resumed_losses") == _losses(run, rank)[SAVE_AT:], f"rank {rank}"


def test_secondaries_checked_from_the_loop_and_after_load(event_ordered):
    record = event_ordered.ranks[0]
    checked_steps = [step for step, _ in record["explicit_checks"]]
    # every CHECK_EVERY steps in the uninterrupted run, then again in the resumed one
    assert checked_steps == list(range(0, STEPS, CHECK_EVERY)) + list(range(SAVE_AT, STEPS, CHECK_EVERY))
    assert all(checked > 0 for _, checked in record["explicit_checks"])
    # plus the one verify_after_load runs at the first backward after fabric.load
    assert record["secondary_checks_run"] == len(checked_steps) + 1


def test_refresh_from_the_loop_drops_every_secondary(event_ordered):
    # dropped between forward and backward at REFRESH_AT; the losses stayed exact (test above)
    for rank in range(4):
        record = event_ordered.ranks[rank]
        assert record["refreshed"] == [[REFRESH_AT, record["secondaries_seen"][REFRESH_AT]]]
        assert record["refreshed"][0][1] > 0


def test_init_module_builds_the_model_sharded(event_ordered):
    shards = [event_ordered.ranks[rank]["shards"] for rank in range(4)]
    full = shards[0]["full"]
    assert all(s["full"] == full for s in shards)
    # each rank holds a quarter (plus padding) from construction on, never the whole model
    assert all(s["local"] < full / 2 for s in shards)
    assert sum(s["local"] for s in shards) >= full
