"""The two-node benchmark end to end on a real rate-limited testbed (root, ``ip`` and ``tc`` needed).

One tiny ``--quick`` comparison (plain ZeRO-3 and hpZ, both through the strategy) is shared by the assertions: hpZ's
cross-node bytes against ZeRO-3's, loss agreement, the model's prediction, and that nothing of the testbed is left.
Times are never checked.
A second, cheaper case interrupts a run with SIGTERM and checks that the namespaces are gone.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from conftest import netns_marks

from lightning_hpz.bench.testbed import LinkShape, TwoNodeTestbed

pytestmark = netns_marks()
BENCH = [sys.executable, "-m", "lightning_hpz.cli", "bench"]


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


def _run_bench(arguments: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run the benchmark; past the timeout end it with SIGTERM, so that it still removes its testbed."""
    process = subprocess.Popen([*BENCH, *arguments], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
        pytest.fail(f"the benchmark took over {timeout:.0f} s:\n{output[-3000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, output)


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench")
    arguments = ["--quick", "--steps", "4", "--warmup", "1", "--configs", "zero3", "hpz-event", "--out", str(out)]
    completed = _run_bench(arguments, timeout=240)
    assert completed.returncode == 0, completed.stdout[-3000:]
    return {"results": json.loads((out / "results.json").read_text()), "out": out}


def test_hpz_cuts_cross_node_bytes_when_parameters_are_regathered(quick_results):
    results = quick_results["results"]
    assert results["zero3_thresholds"]["stage3_max_live_parameters"] == 0
    assert results["headline"]["hpz_over_zero3_cross_node_bytes"] <= 0.78


def test_configurations_agree_on_the_loss(quick_results):
    agreement = quick_results["results"]["loss_agreement"]
    assert agreement["configurations"]["hpz-event"]["expected"] == "exact"
    assert agreement["all_agree"], agreement


def test_measured_bytes_are_within_ten_percent_of_the_model(quick_results):
    pytest.importorskip("lightning_hpz.planning.communication")
    for name, summary in quick_results["results"]["configurations"].items():
        assert 0.9 <= summary["measured_over_predicted"] <= 1.1, (name, summary["measured_over_predicted"])


def test_outputs_are_written_and_the_testbed_is_gone(quick_results):
    out = quick_results["out"]
    assert (out / "results.png").stat().st_size > 0
    assert "| hpz-event |" in (out / "results.md").read_text()
    assert quick_results["results"]["testbed_leftovers"] == []


def test_sigterm_mid_run_ends_the_ranks_and_removes_the_testbed(tmp_path):
    process = subprocess.Popen(
        [*BENCH, "--quick", "--configs", "ddp", "--out", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    names = TwoNodeTestbed(owner_pid=process.pid)
    log = tmp_path / "runs" / "ddp" / "round1" / "log.txt"
    try:
        deadline = time.monotonic() + 90
        while not (log.exists() and log.stat().st_size > 0):  # torchrun has started on the nodes
            assert time.monotonic() < deadline and process.poll() is None, "the run never started"
            time.sleep(0.2)
        assert names.namespace(0) in _namespaces()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
        leftovers = names.leftovers()
        names.created = [names.namespace(0), names.namespace(1)]
        names.close()  # never leave a failed test's namespaces behind
    assert process.returncode != 0
    assert leftovers == []
    ranks = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True, check=False).stdout
    assert ranks == "", f"ranks still running: {ranks}"


def _tcp_buffer_maxima(prefix: list[str]) -> list[int]:
    keys = ["net.ipv4.tcp_wmem", "net.ipv4.tcp_rmem"]
    out = subprocess.run([*prefix, "sysctl", "-n", *keys], capture_output=True, text=True, check=True).stdout
    return [int(line.split()[2]) for line in out.splitlines()]


def test_socket_buffers_cover_the_round_trip_of_a_fast_link_inside_the_namespaces_only():
    host_before = _tcp_buffer_maxima([])
    with TwoNodeTestbed(LinkShape("2gbit")) as testbed:
        # 2 Gbit/s over the shaper's 100 ms queue, both ways: 250 MB/s x 2 x 100 ms
        assert _tcp_buffer_maxima(testbed.exec_prefix(0)) == [50_000_000] * 2
        assert _tcp_buffer_maxima(testbed.exec_prefix(1)) == [50_000_000] * 2
        assert _tcp_buffer_maxima([]) == host_before
