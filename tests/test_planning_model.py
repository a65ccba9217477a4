"""The analytic communication and memory model, checked against the collectives it models, and `lightning-hpz plan`."""

import pytest

from lightning_hpz.cli import main as cli_main
from lightning_hpz.planning import (
    ClusterLayout,
    ZeroSetup,
    memory_per_rank,
    node_link_bytes,
    ring_traffic,
    traffic_per_step,
)
from lightning_hpz.planning.communication import cross_node_link_share

P = 1_000_000
TWO_BY_TWO = ClusterLayout(nodes=2, devices_per_node=2)


def ring_pass(group: int) -> float:
    """Share of a tensor one rank sends in one ring pass over ``group`` ranks."""
    return (group - 1) / group


@pytest.mark.parametrize(("reduction", "reduction_passes"), [("all_reduce", 2), ("reduce_scatter", 1)])
def test_hpz_cross_node_ratio_on_two_by_two(reduction, reduction_passes):
    # Every world collective crosses nodes on the same share of ring links, so the ratio is the ratio of ring passes:
    # ZeRO-3 = forward gather + backward gather + gradient reduction; hpZ drops the backward gather (within a node).
    world = TWO_BY_TWO.world_size
    gather, reduce = ring_pass(world), reduction_passes * ring_pass(world)
    expected = (gather + reduce) / (gather + gather + reduce)
    zero3 = traffic_per_step(P, ZeroSetup(3), TWO_BY_TWO, gradient_reduction=reduction)
    hpz = traffic_per_step(P, ZeroSetup(3, hpz_partition_size=2), TWO_BY_TWO, gradient_reduction=reduction)
    assert hpz.inter_node_bytes / zero3.inter_node_bytes == pytest.approx(expected)
    if reduction == "all_reduce":  # gloo's reduce-scatter: the 0.75 measured with raw DeepSpeed on 2 x 2 CPU ranks
        assert hpz.inter_node_bytes / zero3.inter_node_bytes == pytest.approx(0.75)


def test_without_regather_hpz_saves_nothing():
    zero3 = traffic_per_step(P, ZeroSetup(3), TWO_BY_TWO, regather_in_backward=False)
    hpz = traffic_per_step(P, ZeroSetup(3, 2), TWO_BY_TWO, regather_in_backward=False)
    assert hpz == zero3


def test_ring_link_share_counts_node_boundaries():
    layout = ClusterLayout(nodes=4, devices_per_node=8)
    assert cross_node_link_share(8, layout) == 0  # a group inside each node
    assert cross_node_link_share(32, layout) == pytest.approx(4 / 32)  # one link out of each node
    assert cross_node_link_share(16, layout) == pytest.approx(2 * 2 / 32)  # two groups spanning 2 nodes each


def test_ring_sends_the_same_total_wherever_the_ranks_are():
    tensor = 8e6
    for layout in (ClusterLayout(1, 8), ClusterLayout(2, 4), ClusterLayout(8, 1)):
        traffic = ring_traffic(tensor, 8, layout)
        assert traffic.total_bytes == pytest.approx(tensor * ring_pass(8))
    assert ring_traffic(tensor, 8, ClusterLayout(1, 8)).inter_node_bytes == 0


def test_node_link_carries_what_crosses_the_ring_boundary():
    # A world ring over 2 nodes x 2 ranks: one link leaves each node and carries (g - 1) chunks of T / g.
    tensor = 4e6
    traffic = ring_traffic(tensor, 4, TWO_BY_TWO)
    assert node_link_bytes(traffic, TWO_BY_TWO) == pytest.approx(3 * tensor / 4)


def test_single_node_never_crosses_nodes():
    for zero in (ZeroSetup(0), ZeroSetup(1), ZeroSetup(2), ZeroSetup(3)):
        assert traffic_per_step(P, zero, ClusterLayout(1, 8)).inter_node_bytes == 0


def test_zero_plus_plus_cross_node_volume_is_about_a_quarter_of_zero3():
    # ZeRO++ paper: 3M -> 0.75M across nodes (qwZ halves the forward gather, hpZ drops the backward one, qgZ ~M/4).
    layout = ClusterLayout(16, 8)
    zero3 = traffic_per_step(P, ZeroSetup(3), layout)
    hpz = traffic_per_step(P, ZeroSetup(3, 8), layout)
    zeropp = traffic_per_step(P, ZeroSetup(3, 8, quantized_weights=True, quantized_gradients=True), layout)
    assert hpz.inter_node_bytes / zero3.inter_node_bytes == pytest.approx(2 / 3)
    assert 0.2 < zeropp.inter_node_bytes / zero3.inter_node_bytes < 0.3


def test_qwz_halves_the_forward_gather_up_to_its_scales():
    layout = ClusterLayout(4, 4)
    no_backward = {"regather_in_backward": False}
    plain = traffic_per_step(P, ZeroSetup(3), layout, **no_backward)
    qwz = traffic_per_step(P, ZeroSetup(3, quantized_weights=True), layout, **no_backward)
    reduction = traffic_per_step(P, ZeroSetup(1), layout).total_bytes - ring_traffic(2 * P, 16, layout).total_bytes
    forward_plain, forward_qwz = plain.total_bytes - reduction, qwz.total_bytes - reduction
    assert 0.5 < forward_qwz / forward_plain < 0.51


def test_hpz_group_spanning_nodes_crosses_nodes_in_backward():
    layout = ClusterLayout(4, 2)
    within, across = ZeroSetup(3, 2), ZeroSetup(3, 4)
    assert traffic_per_step(P, across, layout).inter_node_bytes > traffic_per_step(P, within, layout).inter_node_bytes


def test_bytes_grow_linearly_with_model_and_bytes_per_value():
    layout = ClusterLayout(2, 4)
    one = traffic_per_step(P, ZeroSetup(3, 4), layout)
    assert traffic_per_step(3 * P, ZeroSetup(3, 4), layout).total_bytes == pytest.approx(3 * one.total_bytes)
    fp32 = traffic_per_step(P, ZeroSetup(3, 4), layout, param_bytes=4, grad_bytes=4)
    assert fp32.total_bytes == pytest.approx(2 * one.total_bytes)


def test_memory_falls_with_each_stage_and_hpz_adds_its_secondary_shard():
    layout = ClusterLayout(2, 8)
    totals = [memory_per_rank(7e9, ZeroSetup(stage), layout).total for stage in (0, 1, 2, 3)]
    assert totals == sorted(totals, reverse=True)
    zero3 = memory_per_rank(7e9, ZeroSetup(3), layout)
    hpz = memory_per_rank(7e9, ZeroSetup(3, 8), layout)
    assert hpz.total - zero3.total == pytest.approx(7e9 * 2 / 8)
    # ZeRO paper, sec. 5: stage 3 holds (2 + 2 + K) * Psi / Nd bytes with K = 12.
    assert zero3.total == pytest.approx((2 + 2 + 12) * 7e9 / 16)


def test_bad_setups_are_refused():
    with pytest.raises(ValueError, match="stage"):
        ZeroSetup(4)
    with pytest.raises(ValueError, match="stage 3"):
        ZeroSetup(2, hpz_partition_size=8)
    with pytest.raises(ValueError, match="divide"):
        traffic_per_step(P, ZeroSetup(3, 3), ClusterLayout(2, 4))
    with pytest.raises(ValueError, match="gradient_reduction"):
        traffic_per_step(P, ZeroSetup(3), ClusterLayout(2, 4), gradient_reduction="tree")


def test_plan_command_prints_each_configuration(capsys):
    cli_main(["plan", "--params", "7e9", "--nodes", "16", "--devices-per-node", "8", "--inter-node-gbps", "100"])
    out = capsys.readouterr().out
    for row in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "ZeRO-3 + hpZ(8)", "ZeRO++"):
        assert f"\n{row}" in out
    rows = [line.split(" | ") for line in out.splitlines() if " | " in line][2:]  # after header and rule
    times = {cells[0]: float(cells[3]) for cells in rows}
    assert times["ZeRO++ (hpZ(8) + qwZ + qgZ)"] < times["ZeRO-3 + hpZ(8)"] < times["ZeRO-3"]


def test_plan_command_uses_model_presets(capsys):
    presets = pytest.importorskip("lightning_hpz.models.presets")
    cli_main(["plan", "--preset", "llama2-70b", "--nodes", "2", "--devices-per-node", "8"])
    out = capsys.readouterr().out
    assert f"{presets.PRESETS['llama2-70b'].parameters / 1e9:.2f}B parameters" in out
    with pytest.raises(SystemExit, match="Unknown preset 'llama9'"):
        cli_main(["plan", "--preset", "llama9"])


def test_plan_command_refuses_bad_numbers(capsys):
    with pytest.raises(SystemExit):
        cli_main(["plan", "--params", "7e9", "--nodes", "0"])
    assert "--nodes must be positive" in capsys.readouterr().err
