"""Bytes each rank sends per optimizer step, across nodes and within a node, for ZeRO stages 0-3, hpZ, qwZ and qgZ.

The model follows the collectives the engine runs, not the paper's ratios:

* A collective over a group of ``g`` ranks is a ring (gloo and NCCL's ring algorithm): an all-gather or a
  reduce-scatter makes every rank send ``(g - 1) / g`` of the full tensor, an all-reduce twice that.
* Ranks are numbered node-major (``rank = node * devices_per_node + local_rank``, Lightning's and torchrun's order) and
  a group is a block of consecutive ranks; in its ring each rank sends to the next one, the last to the first. Every
  link carries the same bytes, so the share of a rank's bytes that crosses nodes is the share of ring links whose two
  ends sit on different nodes (one per node the group spans, when it spans more than one). The numbers are averages
  over the ranks of the world: in a ring only the rank at a node's boundary sends across, so multiply by
  ``devices_per_node`` for what one node's network link carries.
* ZeRO-3 per step: forward all-gather of the parameters over the world, backward all-gather again (over the hpZ group
  when ``hpz_partition_size > 1``: within a node when the group fits in one), gradient reduce-scatter over the world.
  ZeRO-1/2: gradient reduce-scatter, then an all-gather of the updated parameters after the step. Stage 0 (DDP): one
  gradient all-reduce.
* qwZ sends the forward all-gather as int8 plus one fp32 scale per ``QUANTIZATION_GROUP`` values. qgZ replaces the
  reduce-scatter by ZeRO++'s hierarchical all-to-all of int4 gradients (Wang et al. 2023, arXiv 2306.10209, sec. 3.3):
  an all-to-all inside each node, then one across nodes among the ranks of equal local rank, each holding
  ``1 / devices_per_node`` of the gradients already reduced inside its node.
* Sharding within a group (``ZeroSetup(3, shard_size=s)``): FSDP2's hybrid sharding (HSDP, a 2-D ``DeviceMesh``
  ``("replicate", "shard")``) and DeepSpeed's MiCS (``mics_shard_size``) keep one copy of the model states per group
  of ``s`` consecutive ranks and replicate it across the ``world / s`` groups. Per step: the forward and backward
  all-gathers and the gradient reduce-scatter run inside the group; then every rank all-reduces its gradient shard
  (``1 / s`` of the gradients) with the ranks holding the same shard in the other groups (ranks ``i, i + s, ...``).
  torch's ``FSDPParamGroup`` reduce-scatters over the mesh's shard dimension and all-reduces over its replicate
  dimension (``foreach_reduce``); DeepSpeed's ``MiCS_Optimizer.partition_grads`` reduce-scatters over
  ``param_shard_group`` and ``allreduce_mics_shard_grads`` all-reduces over ``param_repli_group``
  (``deepspeed/runtime/zero/mics.py``, 0.18.9; groups from ``mics_utils._generate_mics_config``). With ``s`` equal
  to the devices of a node, only that all-reduce crosses nodes. MiCS's ``mics_hierarchical_params_gather`` (for a
  group spanning ``k > 1`` nodes) gathers first across nodes among the group's ranks of equal local rank (each sends
  its shard to the ``k - 1`` others), then inside each node; DeepSpeed asserts the group spans more than one node.
* torch's gloo backend runs ``reduce_scatter_tensor`` as a full all-reduce and keeps the local chunk, so it
  moves as many bytes as ``all_reduce`` (the loopback device's counters show it). Pass
  ``gradient_reduction="all_reduce"`` to model a gloo run; that is what makes hpZ's cross-node bytes 0.75 of ZeRO-3's
  on 2 nodes x 2 ranks (with NCCL's reduce-scatter it is 2/3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

GRADIENT_REDUCTIONS = ("reduce_scatter", "all_reduce")
QUANTIZATION_GROUP = 2048  # values per fp32 scale in qwZ/qgZ's block quantization (an assumption of this model)
_SCALE_BYTES = 4


@dataclass(frozen=True)
class ClusterLayout:
    """How many nodes, and how many ranks (devices) on each."""

    nodes: int
    devices_per_node: int

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.devices_per_node < 1:
            raise ValueError(
                f"ClusterLayout(nodes={self.nodes}, devices_per_node={self.devices_per_node}): both must be >= 1."
            )

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node


@dataclass(frozen=True)
class ZeroSetup:
    """The data-parallel scheme: ZeRO ``stage`` (0 = plain DDP), hpZ size and ZeRO++ quantization switches.

    ``shard_size`` (stage 3 only): the ranks one copy of the model states is sharded over, replicated across the
    world's groups of that many consecutive ranks (FSDP2 HSDP's shard dimension, DeepSpeed MiCS's ``mics_shard_size``);
    ``None`` shards over the whole world, as ZeRO does. ``hierarchical_gather``: MiCS's
    ``mics_hierarchical_params_gather`` (needs a group spanning more than one node).
    """

    stage: int
    hpz_partition_size: int = 1
    quantized_weights: bool = False
    quantized_gradients: bool = False
    shard_size: Optional[int] = None
    hierarchical_gather: bool = False

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeroSetup(stage={self.stage}): the stage must be 0 (DDP), 1, 2 or 3.")
        if self.hpz_partition_size < 1:
            raise ValueError(f"ZeroSetup(hpz_partition_size={self.hpz_partition_size}): must be >= 1 (1 = hpZ off).")
        if self.stage != 3 and (self.hpz_partition_size > 1 or self.quantized_weights):
            raise ValueError(
                f"ZeroSetup(stage={self.stage}): hpZ and qwZ exist only for stage 3; set stage=3 or turn them off."
            )
        if self.shard_size is not None:
            self._check_group_sharding()
        elif self.hierarchical_gather:
            raise ValueError("ZeroSetup(hierarchical_gather=True) is MiCS's gather; give the group's shard_size too.")

    def _check_group_sharding(self) -> None:
        if self.stage != 3 or self.shard_size < 1:
            raise ValueError(
                f"ZeroSetup(stage={self.stage}, shard_size={self.shard_size}): sharding within a group is stage 3 "
                "with shard_size >= 1 (FSDP2 HSDP, DeepSpeed MiCS)."
            )
        if self.hpz_partition_size > 1 or self.quantized_weights or self.quantized_gradients:
            raise ValueError(
                f"ZeroSetup(shard_size={self.shard_size}) with hpZ or ZeRO++ quantization: neither FSDP2 HSDP nor "
                "MiCS combines them; use one or the other."
            )


@dataclass(frozen=True)
class TrafficEstimate:
    """Bytes one rank sends per optimizer step (average over the ranks), split by where they go."""

    inter_node_bytes: float
    intra_node_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.inter_node_bytes + self.intra_node_bytes

    def __add__(self, other: TrafficEstimate) -> TrafficEstimate:
        return TrafficEstimate(
            self.inter_node_bytes + other.inter_node_bytes, self.intra_node_bytes + other.intra_node_bytes
        )

    def scaled(self, factor: float) -> TrafficEstimate:
        return TrafficEstimate(self.inter_node_bytes * factor, self.intra_node_bytes * factor)


NO_TRAFFIC = TrafficEstimate(0.0, 0.0)


def node_link_bytes(traffic: TrafficEstimate, layout: ClusterLayout) -> float:
    """Bytes one node sends to other nodes per step (what a node's NIC or veth ``tx_bytes`` counts): the per-rank
    average times the ranks on the node."""
    return traffic.inter_node_bytes * layout.devices_per_node


def rank_groups(group_size: int, world_size: int, stride: int = 1) -> list[list[int]]:
    """The world split into groups of ``group_size`` ranks ``stride`` apart: ``stride=1`` gives consecutive blocks
    (a node, an hpZ or MiCS shard group); ``stride=s`` the ranks at equal position in consecutive blocks of ``s``
    (``world / s`` ranks: a MiCS replicate group, FSDP2 HSDP's replicate dimension)."""
    span = group_size * stride
    if group_size < 1 or stride < 1 or world_size % span:
        raise ValueError(f"Groups of {group_size} ranks {stride} apart do not tile the world of {world_size} ranks.")
    return [
        [block + offset + i * stride for i in range(group_size)]
        for block in range(0, world_size, span)
        for offset in range(stride)
    ]


def cross_node_link_share(group_size: int, layout: ClusterLayout, stride: int = 1) -> float:
    """Share of the ring links that cross nodes, averaged over the world's groups of ``group_size`` ranks ``stride``
    apart (see :func:`rank_groups`)."""
    crossing = 0
    for ranks in rank_groups(group_size, layout.world_size, stride):
        crossing += sum(layout.node_of(r) != layout.node_of(ranks[(i + 1) % group_size]) for i, r in enumerate(ranks))
    return crossing / layout.world_size


def ring_traffic(
    tensor_bytes: float, group_size: int, layout: ClusterLayout, passes: int = 1, stride: int = 1
) -> TrafficEstimate:
    """What one rank sends for ``passes`` ring passes (1: all-gather or reduce-scatter, 2: all-reduce) over groups of
    ``group_size`` ranks ``stride`` apart (consecutive by default), of a tensor of ``tensor_bytes`` (the full size the
    group gathers or reduces)."""
    if group_size <= 1:
        return NO_TRAFFIC
    sent = passes * tensor_bytes * (group_size - 1) / group_size
    share = cross_node_link_share(group_size, layout, stride)
    return TrafficEstimate(sent * share, sent * (1 - share))


def quantized_bytes(values: float, bits: int) -> float:
    """Bytes of ``values`` numbers quantized to ``bits`` with one fp32 scale per group."""
    return values * bits / 8 + values / QUANTIZATION_GROUP * _SCALE_BYTES


def hierarchical_gradient_all_to_all(param_count: int, layout: ClusterLayout, bits: int = 4) -> TrafficEstimate:
    """qgZ: int4 all-to-all inside each node, then across nodes among ranks of equal local rank."""
    devices, nodes = layout.devices_per_node, layout.nodes
    intra = quantized_bytes(param_count, bits) * (devices - 1) / devices
    inter = quantized_bytes(param_count / devices, bits) * (nodes - 1) / nodes
    return TrafficEstimate(inter, intra)


def traffic_per_step(
    param_count: int,
    zero: ZeroSetup,
    layout: ClusterLayout,
    param_bytes: int = 2,
    grad_bytes: int = 2,
    regather_in_backward: bool = True,
    gradient_reduction: str = "reduce_scatter",
) -> TrafficEstimate:
    """Bytes one rank sends per optimizer step (one micro-batch per step), across nodes and within a node.

    Args:
        param_count: parameters of the model (all of them are trained).
        zero: stage, hpZ size, qwZ and qgZ.
        layout: nodes and devices per node.
        param_bytes: bytes per parameter as gathered (2 for bf16/fp16 training, 4 for fp32).
        grad_bytes: bytes per gradient as reduced.
        regather_in_backward: ZeRO-3 only: whether parameters are released after forward and gathered again in
            backward (True for a large model; a small one under DeepSpeed's default ``stage3_max_live_parameters``
            stays gathered, so no backward all-gather happens and hpZ saves nothing).
        gradient_reduction: ``"reduce_scatter"`` (NCCL) or ``"all_reduce"`` (torch's gloo backend, see module doc).
    """
    if gradient_reduction not in GRADIENT_REDUCTIONS:
        raise ValueError(f"gradient_reduction={gradient_reduction!r}: choose one of {GRADIENT_REDUCTIONS}.")
    if zero.hpz_partition_size > 1 and layout.world_size % zero.hpz_partition_size:
        raise ValueError(
            f"hpz_partition_size={zero.hpz_partition_size} does not divide the world size {layout.world_size}."
        )
    world = layout.world_size
    model_bytes, grads = param_count * param_bytes, param_count * grad_bytes
    passes = 2 if gradient_reduction == "all_reduce" else 1
    if zero.shard_size is not None:
        return group_sharded_traffic(model_bytes, grads, zero, layout, regather_in_backward, passes)
    if zero.stage == 0:
        return ring_traffic(grads, world, layout, passes=2)
    reduction = (
        hierarchical_gradient_all_to_all(param_count, layout)
        if zero.quantized_gradients
        else ring_traffic(grads, world, layout, passes=passes)
    )
    if zero.stage in (1, 2):
        return reduction + ring_traffic(model_bytes, world, layout)
    forward_bytes = quantized_bytes(param_count, 8) if zero.quantized_weights else model_bytes
    forward = ring_traffic(forward_bytes, world, layout)
    backward_group = zero.hpz_partition_size if zero.hpz_partition_size > 1 else world
    backward = ring_traffic(model_bytes, backward_group, layout) if regather_in_backward else NO_TRAFFIC
    return forward + backward + reduction


def group_sharded_traffic(
    model_bytes: float,
    grad_bytes: float,
    zero: ZeroSetup,
    layout: ClusterLayout,
    regather_in_backward: bool = True,
    reduction_passes: int = 1,
) -> TrafficEstimate:
    """ZeRO-3 sharded within groups of ``zero.shard_size`` consecutive ranks and replicated across them (FSDP2 HSDP,
    DeepSpeed MiCS): the gathers and the gradient reduce-scatter (``reduction_passes`` = 2 where it runs as an
    all-reduce) inside the group, then an all-reduce of each rank's ``1 / shard_size`` of the gradients with the
    ranks holding the same shard in the other groups."""
    shard, world = zero.shard_size, layout.world_size
    if world % shard:
        raise ValueError(f"shard_size={shard} does not divide the world size {world}.")
    if zero.hierarchical_gather:
        gather = _hierarchical_gather(model_bytes, shard, layout)
    else:
        gather = ring_traffic(model_bytes, shard, layout)
    backward = gather if regather_in_backward else NO_TRAFFIC
    reduction = ring_traffic(grad_bytes, shard, layout, passes=reduction_passes)
    replicas = ring_traffic(grad_bytes / shard, world // shard, layout, passes=2, stride=shard)
    return gather + backward + reduction + replicas


def _hierarchical_gather(model_bytes: float, shard: int, layout: ClusterLayout) -> TrafficEstimate:
    """MiCS's ``_hierarchical_all_gather_params``: an all-gather across the ``k`` nodes a group spans, among its ranks
    of equal local rank (``k`` shards each), then one inside each node of the ``k`` gathered chunks."""
    devices = layout.devices_per_node
    nodes_spanned = shard // devices
    if shard % devices or nodes_spanned < 2:
        raise ValueError(
            f"hierarchical_gather with shard_size={shard} on {devices} devices per node: MiCS gathers hierarchically "
            "only for a group spanning whole nodes, more than one (DeepSpeed asserts 'sharding spans on single node, "
            "no need for hierarchy allgather'); turn it off."
        )
    across = ring_traffic(model_bytes / devices, nodes_spanned, layout, stride=devices)
    within = ring_traffic(model_bytes, devices, layout)
    return across + within
