"""Two hpZ models in one process: DeepSpeed builds its hpZ groups once per process and asserted on the second."""

import pytest
from conftest import run_script

pytestmark = pytest.mark.multiprocess


def test_second_trainer_in_the_same_process_trains_identically(tmp_path):
    run = run_script("two_trainers.py", {}, tmp_path / "out", ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    for rank in (0, 1):
        record = run.ranks[rank]
        assert record["second"] == record["first"]  # same seed, same arithmetic, reused groups
        assert min(record["secondaries"]) == 6  # the second model really runs hpZ
