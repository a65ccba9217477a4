"""FSDP2 HSDP and DeepSpeed MiCS in the planner (``ZeroSetup(3, shard_size=...)``), against hand-computed bytes.

Small case: 1000 parameters of 4 bytes (4000 bytes), so each number below is worked out in the comment beside it from
the collectives each method runs per step (see ``lightning_hpz/planning/communication.py``).
"""

import pytest

from lightning_hpz.bench import configurations
from lightning_hpz.bench.prediction import predicted_cross_node_bytes
from lightning_hpz.cli import main as cli_main
from lightning_hpz.planning import ClusterLayout, ZeroSetup, memory_per_rank, traffic_per_step
from lightning_hpz.planning.communication import cross_node_link_share, rank_groups

PARAMS = 1000
FP32 = {"param_bytes": 4, "grad_bytes": 4}
TWO_BY_TWO = ClusterLayout(nodes=2, devices_per_node=2)
FOUR_BY_TWO = ClusterLayout(nodes=4, devices_per_node=2)


def test_replicate_groups_are_the_ranks_of_equal_position_in_each_shard_group():
    # DeepSpeed's _generate_mics_config: shard groups arange(world).reshape(-1, s), replicate groups its columns;
    # torch's 2-D mesh (replicate, shard) is the same row-major grid.
    assert rank_groups(4, 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert rank_groups(2, 8, stride=4) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert cross_node_link_share(2, FOUR_BY_TWO, stride=4) == 1.0  # every replica lives on another node
    with pytest.raises(ValueError, match="tile"):
        rank_groups(3, 8, stride=2)


@pytest.mark.parametrize(("reduction", "intra"), [("reduce_scatter", 6000.0), ("all_reduce", 8000.0)])
def test_replica_per_node_on_two_by_two(reduction, intra):
    # Forward and backward all-gather inside the node: 4000 * 1/2 = 2000 each, intra-node.
    # Gradient reduce-scatter inside the node: 2000 (4000 where gloo runs it as an all-reduce), intra-node.
    # All-reduce of the 2000-byte gradient shard with the other node's replica: 2 * 2000 * 1/2 = 2000, cross-node.
    traffic = traffic_per_step(PARAMS, ZeroSetup(3, shard_size=2), TWO_BY_TWO, gradient_reduction=reduction, **FP32)
    assert traffic.inter_node_bytes == pytest.approx(2000.0)
    assert traffic.intra_node_bytes == pytest.approx(intra)


def test_replica_per_node_sends_a_third_of_zero3_cross_node_on_gloo():
    # ZeRO-3 on 2 x 2 (half of each ring's links cross): gathers 2 * 3000 * 0.5 + all-reduce 6000 * 0.5 = 6000.
    zero3 = traffic_per_step(PARAMS, ZeroSetup(3), TWO_BY_TWO, gradient_reduction="all_reduce", **FP32)
    hsdp = traffic_per_step(PARAMS, ZeroSetup(3, shard_size=2), TWO_BY_TWO, gradient_reduction="all_reduce", **FP32)
    assert zero3.inter_node_bytes == pytest.approx(6000.0)
    assert hsdp.inter_node_bytes / zero3.inter_node_bytes == pytest.approx(1 / 3)


def test_mics_group_spanning_two_nodes_flat_and_hierarchical():
    # 4 nodes x 2, shard_size 4: groups [0..3] and [4..7], each spanning two nodes; replicas [i, i + 4].
    flat = traffic_per_step(PARAMS, ZeroSetup(3, shard_size=4), FOUR_BY_TWO, **FP32)
    # Flat ring gather over 4: 4000 * 3/4 = 3000 sent, 2 of the group's 4 links cross: 1500 + 1500, twice.
    # Reduce-scatter over the group: the same 1500 + 1500. Replica all-reduce of 1000 bytes: 2 * 1000 * 1/2 = 1000.
    assert flat.inter_node_bytes == pytest.approx(1500 * 3 + 1000)
    assert flat.intra_node_bytes == pytest.approx(1500 * 3)
    hierarchical = traffic_per_step(PARAMS, ZeroSetup(3, shard_size=4, hierarchical_gather=True), FOUR_BY_TWO, **FP32)
    # Hierarchical gather: each rank sends its 1000-byte shard to its partner on the other node (1000 across), then
    # gathers both 2000-byte chunks inside the node (2 * 1000 = 2000 within); forward and backward.
    assert hierarchical.inter_node_bytes == pytest.approx(1000 * 2 + 1500 + 1000)
    assert hierarchical.intra_node_bytes == pytest.approx(2000 * 2 + 1500)


def test_without_regather_only_the_forward_gather_remains():
    once = traffic_per_step(PARAMS, ZeroSetup(3, shard_size=2), TWO_BY_TWO, regather_in_backward=False, **FP32)
    assert once.intra_node_bytes == pytest.approx(2000 + 2000)  # forward gather + reduce-scatter
    assert once.inter_node_bytes == pytest.approx(2000)


def test_memory_shards_every_model_state_over_the_group():
    # 1000 params, bf16 (2 bytes), Adam 12 bytes, shard over 2 of the 4 ranks: 1000 + 1000 + 6000 bytes.
    estimate = memory_per_rank(PARAMS, ZeroSetup(3, shard_size=2), TWO_BY_TWO)
    assert (estimate.parameters, estimate.gradients, estimate.optimizer_states) == (1000, 1000, 6000)
    assert estimate.secondary_shards == 0
    zero3 = memory_per_rank(PARAMS, ZeroSetup(3), TWO_BY_TWO)
    assert estimate.total == pytest.approx(2 * zero3.total)


def test_bad_group_sharding_is_refused():
    with pytest.raises(ValueError, match="stage 3"):
        ZeroSetup(2, shard_size=2)
    with pytest.raises(ValueError, match="hpZ"):
        ZeroSetup(3, hpz_partition_size=2, shard_size=2)
    with pytest.raises(ValueError, match="shard_size"):
        ZeroSetup(3, hierarchical_gather=True)
    with pytest.raises(ValueError, match="divide"):
        traffic_per_step(PARAMS, ZeroSetup(3, shard_size=3), TWO_BY_TWO)
    with pytest.raises(ValueError, match="spans on single node"):  # DeepSpeed's own assertion, named
        traffic_per_step(PARAMS, ZeroSetup(3, shard_size=2, hierarchical_gather=True), TWO_BY_TWO)


def test_bench_predicts_hsdp_and_mics_as_a_replica_per_node():
    parameters = 1_000_000
    predicted = {
        name: predicted_cross_node_bytes(configurations.CONFIGURATIONS[name], parameters, devices_per_node=2)
        for name in ("zero3", "fsdp2-hsdp", "deepspeed-mics")
    }
    assert predicted["fsdp2-hsdp"][0] == predicted["deepspeed-mics"][0]
    assert predicted["fsdp2-hsdp"][0] == pytest.approx(predicted["zero3"][0] / 3)
    assert "shard_size=2" in predicted["deepspeed-mics"][1]


def test_mics_is_left_out_of_the_defaults_and_refused_by_name_where_deepspeed_lacks_it(monkeypatch):
    monkeypatch.setattr(configurations, "mics_available", lambda: False)
    assert "deepspeed-mics" not in [c.name for c in configurations.select(None, quick=False)]
    assert "fsdp2-hsdp" in [c.name for c in configurations.select(None, quick=False)]
    with pytest.raises(ValueError, match="removed MiCS"):
        configurations.select(["zero3", "deepspeed-mics"], quick=False)
    monkeypatch.setattr(configurations, "mics_available", lambda: True)
    monkeypatch.setattr(configurations, "gloo_coalesces", lambda: False)  # torch 2.13's gloo
    with pytest.raises(ValueError, match="does not implement startCoalescing"):
        configurations.select(["deepspeed-mics"], quick=False)
    monkeypatch.setattr(configurations, "gloo_coalesces", lambda: True)
    assert configurations.select(["deepspeed-mics"], quick=False)[0].shard_size(2) == 2


def test_gloo_coalescing_is_asked_of_torch():
    assert isinstance(configurations.gloo_coalesces(), bool)


def test_plan_command_lists_hsdp_and_mics(capsys):
    cli_main(["plan", "--params", "7e9", "--nodes", "4", "--devices-per-node", "8", "--inter-node-gbps", "100"])
    rows = {line.split(" | ")[0]: line.split(" | ") for line in capsys.readouterr().out.splitlines() if " | " in line}
    # 14 GB of bf16 gradients, an 8-way shard all-reduced over 4 replicas: 2 * 1.75 GB * 3/4 = 2.625 GB per rank.
    for name in ("FSDP2 HSDP (shard 8)", "MiCS (mics_shard_size=8)"):
        assert float(rows[name][1]) == pytest.approx(2.625)
    assert float(rows["FSDP2 HSDP (shard 8)"][3]) < float(rows["ZeRO-3 + hpZ(8)"][3])
