"""Every rank exits 0 after fit; a failure on any one rank ends all of them instead of leaving them blocked."""

import subprocess
import sys

import pytest
from conftest import assert_succeeded, run_script

pytestmark = pytest.mark.multiprocess


def _survivors(marker: str) -> list[str]:
    listing = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in listing.splitlines() if marker in line and "ps -eo" not in line]


def test_every_rank_exits_cleanly_under_torchrun(tmp_path):
    # torchrun reports the exit status of each rank: an abort at interpreter shutdown on any of them fails the run
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    strategy = {"hpz_partition_size": 2}
    run = run_script("toy_training.py", {"steps": 4, "strategy": strategy}, tmp_path / "out", launcher=launcher)
    assert_succeeded(run)
    assert "terminate called" not in run.output
    assert len({record["pid"] for record in run.ranks.values()}) == 4


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_failure_on_one_rank_ends_all_ranks(tmp_path, failing_rank):
    out = tmp_path / f"fail{failing_rank}"
    options = {"steps": 20, "fail_on_rank": failing_rank, "strategy": {"hpz_partition_size": 2}}
    # without the strategy's clean-up the surviving ranks would wait in a collective for the 30-minute timeout
    run = run_script("toy_training.py", options, out, timeout=240)
    assert run.returncode != 0
    assert f"deliberate failure on rank {failing_rank}" in run.output
    assert not run.ranks  # no rank reached the end of training
    assert _survivors(str(out)) == []
