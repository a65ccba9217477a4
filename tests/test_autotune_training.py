"""``HpzStrategy(autotune=True)`` in real processes: two simulated nodes of 2 CPU ranks each (gloo), one launch.

Asserts that every rank applies the same choice, that the DeepSpeed engine is built with it, that a resume re-uses the
checkpoint's choice without measuring, and that values the user gave are kept.
"""

from __future__ import annotations

import pytest
from conftest import launch_nodes

pytestmark = pytest.mark.multiprocess  # two nodes of 2 real ranks: it starts with the launching files, not last

TUNED_KEYS = (
    "zero_hpz_partition_size",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("autotune")
    records = launch_nodes("autotune_training.py", {}, out, nodes=2)
    assert sorted(records) == [0, 1, 2, 3]
    return records


def test_every_rank_applies_the_same_measured_choice(ranks):
    decisions = [ranks[r]["tuned"]["decision"] for r in range(4)]
    assert all(d == decisions[0] for d in decisions)
    decision = decisions[0]
    assert decision["source"] == "probe" and decision["layout"] == [2, 2]
    assert decision["links"]["inter_node_gbps"] > 0 and decision["links"]["intra_node_gbps"] > 0
    # recorded for the log table; how long it takes is a benchmark's business (autotune_testbed: about 3 s here)
    assert decision["links"]["probe_seconds"] > 0
    assert {c["hpz_partition_size"] for c in decision["candidates"]} == {1, 2}
    assert decision["candidate"] in {c["name"] for c in decision["candidates"] if c["fits"]}


def test_every_rank_gets_the_busiest_ranks_memory_peak_after_step_one(ranks):
    for phase in ("tuned", "resumed"):  # a resume checks after its own first step
        checks = [ranks[r][phase]["memory_check"] for r in range(4)]
        assert checks[0] is not None and all(c == checks[0] for c in checks)
        # taken during the run, so at most the largest peak any rank reached by its end
        assert 0 < checks[0]["peak_gib"] * 2**30 <= max(ranks[r][phase]["own_peak_bytes"] for r in range(4))
        assert checks[0]["budget_gib"] == ranks[0][phase]["decision"]["memory_budget_gib"]


def test_the_engine_is_built_with_the_choice(ranks):
    for r in range(4):
        tuned = ranks[r]["tuned"]
        chosen = {
            "zero_hpz_partition_size": tuned["decision"]["hpz_partition_size"],
            **tuned["decision"]["zero_thresholds"],
        }
        assert tuned["strategy_config"] == chosen
        assert tuned["engine_config"] == chosen


def test_a_resume_reuses_the_checkpoints_choice_without_measuring(ranks):
    for r in range(4):
        tuned, resumed = ranks[r]["tuned"], ranks[r]["resumed"]
        assert resumed["decision"]["source"] == "checkpoint"
        assert resumed["global_step"] == 4
        for key in ("hpz_partition_size", "zero_thresholds", "candidate", "links"):
            assert resumed["decision"][key] == tuned["decision"][key]
        assert resumed["engine_config"] == tuned["engine_config"]


def test_explicit_values_win_over_the_tuner(ranks):
    for r in range(4):
        explicit = ranks[r]["explicit"]
        assert explicit["decision"]["source"] == "probe"  # "retune" measures again
        assert explicit["engine_config"]["zero_hpz_partition_size"] == 2
        assert explicit["engine_config"]["stage3_max_live_parameters"] == 0
        assert {c["hpz_partition_size"] for c in explicit["decision"]["candidates"]} == {2}
