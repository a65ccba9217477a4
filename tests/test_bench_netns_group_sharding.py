"""Cross-node bytes of FSDP2 HSDP (and DeepSpeed MiCS, where DeepSpeed has it) on the real two-node testbed.

A correctness run, not a measurement of time: ``--quick`` (0.5M parameters), 4 steps, and a 10 Gbit/s link that the
CPU ranks cannot fill, so the shaper never holds a byte back. The veth counters must lie within 5% of the planner's
``ZeroSetup(3, shard_size=2)`` (only the gradient shard's all-reduce between the two replicas crosses nodes).
"""

from __future__ import annotations

import json

from conftest import netns_marks
from test_bench_netns import _run_bench

from lightning_hpz.bench import configurations

pytestmark = netns_marks()


def test_replica_per_node_cross_node_bytes_match_the_planner(tmp_path):
    candidates = ("fsdp2-hsdp", "deepspeed-mics")
    names = [n for n in candidates if configurations.CONFIGURATIONS[n].unavailable_reason() is None]
    arguments = ["--quick", "--steps", "4", "--warmup", "1", "--bandwidth", "10gbit", "--configs", *names]
    completed = _run_bench([*arguments, "--out", str(tmp_path)], timeout=300)
    assert completed.returncode == 0, completed.stdout[-3000:]
    outcome = json.loads((tmp_path / "results.json").read_text())
    for name in names:
        summary = outcome["configurations"][name]
        assert 0.95 <= summary["measured_over_predicted"] <= 1.05, (name, summary["measured_over_predicted"])
    assert outcome["testbed_leftovers"] == []
