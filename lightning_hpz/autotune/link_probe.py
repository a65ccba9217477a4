"""Measure the links at start-up: all-gathers inside each node and between nodes, agreed on by every rank.

Inside a node, each node's ranks all-gather among themselves; between nodes, the ranks of equal local rank do, all at
once, so together they load a node's network link as ZeRO's world-wide gathers do. Each measurement doubles the
message until one gather takes ``TARGET_SECONDS`` (or reaches ``MAX_BYTES``), then repeats it and keeps the fastest:
other work on the machine (or a descheduled rank) can only slow a transfer down, never speed it up.
Every timing is the slowest rank's (an all-reduce of the maximum), so every rank takes the same decisions from the same
numbers: the doubling stops at the same step everywhere and the planner gets identical figures.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Optional

from lightning_hpz import collectives
from lightning_hpz.planning.communication import ClusterLayout
from lightning_hpz.planning.tuning import LinkFigures

START_BYTES = 256 * 1024
MAX_BYTES = 64 * 2**20
TARGET_SECONDS = 0.15  # long enough that set-up costs and timer noise are small next to the transfer
REPEATS = 3
LATENCY_REPEATS = 5


def probe_links(layout: ClusterLayout, global_rank: int) -> LinkFigures:
    """Intra- and inter-node all-gather bandwidth and latency (a collective: every rank of the world calls it)."""
    start = time.perf_counter()
    nodes, devices = layout.nodes, layout.devices_per_node
    intra = _make_groups([[n * devices + i for i in range(devices)] for n in range(nodes)], devices > 1)
    inter = _make_groups([[n * devices + i for n in range(nodes)] for i in range(devices)], nodes > 1)
    try:
        inter_rate = inter_latency = None
        if nodes > 1:
            inter_latency, rate = _measure(inter, nodes)
            inter_rate = rate * devices  # every local rank sent that much at once through the node's link
        if devices > 1:
            intra_latency, intra_rate = _measure(intra, devices)
        else:  # no intra-node traffic exists; the figures are never used
            intra_latency, intra_rate = inter_latency or 0.0, inter_rate or 1.0
    finally:
        collectives.destroy_group(intra)
        collectives.destroy_group(inter)
    elapsed = collectives.all_reduce_values([time.perf_counter() - start], op="max")[0]
    return LinkFigures(intra_rate, intra_latency, inter_rate, inter_latency, probe_seconds=elapsed)


def _make_groups(rank_lists: list[list[int]], needed: bool) -> Optional[Any]:
    # Every rank creates every group (torch requires it), also those it is not in.
    return collectives.new_subgroups(rank_lists) if needed else None


def _measure(group: Any, group_size: int) -> tuple[float, float]:
    """(latency in seconds, bytes per second one rank sends) of all-gathers over ``group``."""
    _agreed_seconds(group, 1)  # the first collective on a group may set up connections
    latency = statistics.median(_agreed_seconds(group, 1) for _ in range(LATENCY_REPEATS))
    size = START_BYTES
    seconds = _agreed_seconds(group, size)
    while seconds < TARGET_SECONDS and size < MAX_BYTES:
        size *= 2
        seconds = _agreed_seconds(group, size)
    seconds = min([seconds, *(_agreed_seconds(group, size) for _ in range(REPEATS - 1))])
    return latency, (group_size - 1) * size / seconds


def _agreed_seconds(group: Any, size: int) -> float:
    return collectives.all_reduce_values([collectives.timed_all_gather(size, group)], op="max")[0]
