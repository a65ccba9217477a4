"""A step that does not log waits for nothing: the package's callbacks and the default strategy issue no blocking host
synchronization on it (tests/scripts/host_syncs.py counts them on 2 CPU processes, real DeepSpeed over gloo)."""

import pytest
from conftest import assert_succeeded, run_script

pytestmark = pytest.mark.multiprocess

STEPS, ACCUMULATE, LOG_EVERY = 8, 2, 4


def _launch(module_tmp, name: str, **options):
    options = {"steps": STEPS, "accumulate": ACCUMULATE, "log_every": LOG_EVERY, **options}
    run = run_script("host_syncs.py", options, module_tmp / name, ranks=2)
    assert_succeeded(run, ranks=2)
    return run


def _non_logging_batches(record: dict) -> list[str]:
    """Batches of optimizer steps that neither log nor check secondaries (the check runs at step 0)."""
    step_of = {batch: -(-(int(batch) + 1) // ACCUMULATE) for batch in record["steps_after"]}  # the step it ends in
    return [batch for batch, step in step_of.items() if step % LOG_EVERY and step > 1]


@pytest.fixture(scope="module")
def callbacks_run(module_tmp):
    return _launch(module_tmp, "callbacks")


def test_no_blocking_sync_on_a_step_that_does_not_log(callbacks_run):
    for rank, record in callbacks_run.ranks.items():
        batches = _non_logging_batches(record)
        assert len(batches) >= 8, batches  # steps 2, 3, 5, 6, 7 (two micro-batches each) were looked at
        assert {batch: record["syncs"].get(batch, {}) for batch in batches} == {batch: {} for batch in batches}, rank
        assert record["preemption_callback"] == ["PreemptionCheckpoint"]  # the strategy's default callback ran


def test_logging_steps_do_sync_so_the_count_sees_syncs(callbacks_run):
    # the throughput monitor reads its steps when it logs: the counter must see that, or it proves nothing
    record = callbacks_run.ranks[0]
    logging = [batch for batch, step in record["steps_after"].items() if step % LOG_EVERY == 0 and int(batch) % 2]
    assert any(record["syncs"].get(batch) for batch in logging), record["syncs"]


def test_secondary_check_runs_once_per_step_under_accumulation(callbacks_run):
    assert {record["secondary_checks"] for record in callbacks_run.ranks.values()} == {1}


def test_loss_stability_monitor_does_not_sync_either(module_tmp):
    run = _launch(module_tmp, "loss_monitor", loss_monitor=True)
    for rank, record in run.ranks.items():
        batches = _non_logging_batches(record)
        assert {batch: record["syncs"].get(batch, {}) for batch in batches} == {batch: {} for batch in batches}, rank
        assert record["losses_judged"] == STEPS * ACCUMULATE  # every micro-batch's loss was read, at logging steps
