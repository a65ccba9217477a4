"""The autotuner's choice logic against synthetic measurements (no processes, no torch distributed)."""

from __future__ import annotations

import json

import pytest

from lightning_hpz.autotune.tuner import fixed_settings, read_recorded_decision
from lightning_hpz.planning.communication import ClusterLayout
from lightning_hpz.planning.tuning import (
    LIVE,
    PERSISTENCE,
    PREFETCH,
    REUSE,
    FixedSettings,
    LinkFigures,
    ModelFacts,
    NoCandidateFitsError,
    TrainingFacts,
    candidates,
    choose,
    persistence_threshold,
    profile_thresholds,
    retained_fraction,
)
from lightning_hpz.planning.tuning_decision import TuningDecision

MB = 1e6
# Ten 1M-parameter layers and ten modules of two 1000-element vectors (norms): 10.02M parameters, fp32 under gloo.
FACTS = ModelFacts(tuple((1_000_000,) for _ in range(10)) + tuple((1000, 1000) for _ in range(10)))
LAYOUT = ClusterLayout(nodes=2, devices_per_node=2)
FP32_GLOO = TrainingFacts(param_bytes=4, grad_bytes=4, optimizer_bytes_per_param=12, gradient_reduction="all_reduce")
TIGHT = 110 * MB  # releases fit, keeping the whole model gathered does not
PLENTY = 10_000 * MB


def links(inter_gbps: float, intra_gbps: float = 10.0, inter_latency_s: float = 200e-6) -> LinkFigures:
    return LinkFigures(intra_gbps * 1e9 / 8, 50e-6, inter_gbps * 1e9 / 8, inter_latency_s)


NOTHING_FIXED = FixedSettings()


def decide(link: LinkFigures, budget: float = TIGHT, fixed: FixedSettings = NOTHING_FIXED, layout=LAYOUT):
    found = candidates(FACTS, layout, link, FP32_GLOO, fixed, budget)
    pick, why = choose(found, budget)
    return pick, found, why


def test_slow_link_and_tight_memory_choose_hpz_over_the_node_with_released_parameters():
    pick, found, _ = decide(links(inter_gbps=0.05))
    assert (pick.hpz_partition_size, pick.name) == (2, "hpz2-release")
    assert pick.zero_thresholds[REUSE] == 0  # nothing is used again soon enough to stay: all re-gathered
    assert pick.zero_thresholds[LIVE] >= pick.zero_thresholds[PREFETCH]  # prefetching still has room
    fitting = [c for c in found if c.fits]
    assert pick.predicted_comm_s == min(c.predicted_comm_s for c in fitting)
    assert any(not c.fits for c in found)  # keeping the whole model gathered exceeds the budget


def test_a_cross_node_link_faster_than_the_intra_node_one_turns_hpz_off():
    pick, found, _ = decide(links(inter_gbps=100.0, intra_gbps=10.0, inter_latency_s=50e-6))
    assert pick.hpz_partition_size == 1
    hpz2 = {c.name: c for c in found}["hpz2-release"]
    assert hpz2.predicted_comm_s > {c.name: c for c in found}["hpz1-release"].predicted_comm_s


def test_plenty_of_memory_prefers_near_equal_speed_with_less_memory():
    pick, found, why = decide(links(inter_gbps=0.05), budget=PLENTY)
    assert all(c.fits for c in found)
    fastest = min(c.predicted_comm_s for c in found)
    assert pick.predicted_comm_s <= fastest * 1.02
    near = [c for c in found if c.predicted_comm_s <= fastest * 1.02]
    assert pick.predicted_memory_bytes == min(c.predicted_memory_bytes for c in near)
    assert "near-ties" in why


def test_a_high_cross_node_latency_favours_gathers_inside_the_node():
    fast_but_far = links(inter_gbps=100.0, intra_gbps=10.0, inter_latency_s=2e-3)
    pick, _, _ = decide(fast_but_far)
    assert pick.hpz_partition_size == 2


def test_one_node_offers_no_hpz_candidates():
    one_node = ClusterLayout(1, 4)
    link = LinkFigures(10e9 / 8, 50e-6)
    pick, found, _ = decide(link, budget=PLENTY, layout=one_node)
    assert {c.hpz_partition_size for c in found} == {1}
    assert pick.name == "hpz1-keep"  # nothing crosses a slow link: keep everything gathered when it fits


def test_an_explicit_hpz_size_and_thresholds_are_kept():
    fixed = FixedSettings(hpz_partition_size=1, thresholds={LIVE: 12345})
    pick, found, _ = decide(links(inter_gbps=0.05), budget=PLENTY, fixed=fixed)
    assert {c.hpz_partition_size for c in found} == {1}
    assert {c.zero_thresholds[LIVE] for c in found} == {12345}
    assert pick.hpz_partition_size == 1 and pick.zero_thresholds[LIVE] == 12345


def test_nothing_fits_names_the_smallest_need_and_the_fixes():
    with pytest.raises(NoCandidateFitsError, match=r"autotune_memory_gib.*offload_optimizer"):
        decide(links(inter_gbps=0.05), budget=10 * MB)


def test_retained_fraction_follows_the_reuse_distance_and_the_prefetch_bucket():
    no_prefetch = {LIVE: 10**9, PREFETCH: 0}
    assert retained_fraction({**no_prefetch, REUSE: 0}, 1000) == 0.0
    assert retained_fraction({**no_prefetch, REUSE: 1000}, 1000) == 0.5
    assert retained_fraction({**no_prefetch, REUSE: 10**9}, 1000) == 1.0
    assert retained_fraction({LIVE: 10**9, PREFETCH: 100, REUSE: 0}, 1000) == 0.2  # two buckets at the turn
    assert retained_fraction({LIVE: 0, PREFETCH: 100, REUSE: 0}, 1000) == 0.0  # live parameters cap prefetching
    keep = profile_thresholds("keep", FACTS, 0)
    assert retained_fraction(keep, FACTS.parameter_count) == 1.0


def test_persistence_keeps_only_small_parameters_within_one_percent():
    assert persistence_threshold(FACTS) == 1000  # the norms: 20k elements, 0.2% of the model
    tiny_share = ModelFacts(((10,), (50_000,), (1_000_000,)))  # 50k would be 5%: only the 10-element one stays
    assert persistence_threshold(tiny_share) == 10


def test_decision_round_trips_and_its_table_marks_the_choice():
    pick, found, why = decide(links(inter_gbps=0.2))
    decision = TuningDecision.from_choice(pick, found, links(0.2), TIGHT, why, (2, 2))
    again = TuningDecision.from_dict(json.loads(json.dumps(decision.to_dict())), source="checkpoint")
    assert again.zero_section() == decision.zero_section() and again.source == "checkpoint"
    table = decision.table()
    assert f"{pick.name} <- chosen" in table and "inter-node 0.2 Gbit/s" in table
    assert decision.zero_section()["zero_hpz_partition_size"] == pick.hpz_partition_size


def test_same_measurements_give_the_same_choice():
    first, _, _ = decide(links(inter_gbps=0.2))
    second, _, _ = decide(links(inter_gbps=0.2))
    assert first == second


def test_user_values_are_read_from_the_arguments_and_the_config():
    fixed = fixed_settings("auto", {"zero_optimization": {PERSISTENCE: 0, "stage3_max_live_parameters": 7}})
    assert fixed.hpz_partition_size is None and fixed.thresholds == {PERSISTENCE: 0, LIVE: 7}
    assert fixed_settings(2, {}).hpz_partition_size == 2
    assert fixed_settings(None, {"zero_optimization": {"zero_hpz_partition_size": 4}}).hpz_partition_size == 4


def test_a_recorded_decision_is_read_from_a_checkpoint_manifest(tmp_path):
    pick, found, why = decide(links(inter_gbps=0.2))
    decision = TuningDecision.from_choice(pick, found, links(0.2), TIGHT, why, (2, 2))
    checkpoint = tmp_path / "epoch=0.ckpt"
    checkpoint.mkdir()
    manifest = {"format": 1, "run": {"autotune": decision.to_dict()}, "files": {}}
    (checkpoint / "hpz_manifest.json").write_text(json.dumps(manifest))
    assert read_recorded_decision(checkpoint) == decision.to_dict()
    assert read_recorded_decision(tmp_path / "missing") is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stage": 2, "autotune": True}, r"needs stage=3 \(stage=2\)"),
        ({"autotune": "yes"}, r"autotune='yes': choose True, False or 'retune'"),
        ({"autotune": True, "autotune_memory_gib": 0}, r"autotune_memory_gib=0: give a positive"),
    ],
)
def test_bad_autotune_settings_are_refused_when_the_strategy_is_built(kwargs, message):
    from lightning_hpz import HpzConfigurationError, HpzStrategy

    with pytest.raises(HpzConfigurationError, match=message):
        HpzStrategy(**kwargs)


def test_thresholds_given_under_deepspeeds_field_names_count_as_set_and_keep_their_spelling():
    fixed = fixed_settings(None, {"zero_optimization": {"prefetch_bucket_size": 5}})
    assert fixed.thresholds == {PREFETCH: 5}
    pick, found, why = decide(links(inter_gbps=0.2), budget=PLENTY, fixed=fixed)
    decision = TuningDecision.from_choice(pick, found, links(0.2), PLENTY, why, (2, 2))
    section = decision.zero_section(spelled_as={"prefetch_bucket_size": 5})
    assert section["prefetch_bucket_size"] == 5 and PREFETCH not in section
    assert REUSE in section  # the others keep DeepSpeed's key


def test_frozen_parameters_are_gathered_but_have_no_gradients_or_optimizer_states():
    all_trained = candidates(FACTS, LAYOUT, links(0.2), FP32_GLOO, NOTHING_FIXED, PLENTY)
    half_frozen = ModelFacts(FACTS.module_parameters, trainable_elements=FACTS.parameter_count // 2)
    frozen = candidates(half_frozen, LAYOUT, links(0.2), FP32_GLOO, NOTHING_FIXED, PLENTY)
    for trained, partly in zip(all_trained, frozen, strict=True):
        assert partly.predicted_memory_bytes < trained.predicted_memory_bytes
        assert partly.predicted_comm_s < trained.predicted_comm_s  # less to reduce, as much to gather
        assert partly.predicted_comm_s > 0.5 * trained.predicted_comm_s


def test_model_facts_count_frozen_parameters_apart():
    import torch

    from lightning_hpz.autotune.tuner import model_facts

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].requires_grad_(False)
    facts = model_facts(model)
    assert facts.module_parameters == ((16, 4), (8, 2))
    assert facts.trainable_count == 10 and facts.parameter_count == 30
