"""Measure the links at start-up: all-gathers inside each node and between nodes, agreed on by every rank.

Inside a node, each node's ranks all-gather among themselves; between nodes, the ranks of equal local rank do, all at
once, so together they load a node's network link as ZeRO's world-wide gathers do. Each measurement doubles the
message until one gather takes half of ``TARGET_SECONDS`` (or reaches ``MAX_BYTES``) and scales it to take about
``TARGET_SECONDS``; then both kinds are timed ``REPEATS`` times, alternately, and each keeps its fastest: other work
on the machine (or a descheduled rank) can only slow a transfer down, never speed it up.
Every timing is the slowest rank's (an all-reduce of the maximum), so every rank takes the same decisions from the same
numbers: the doubling stops at the same step everywhere and the planner gets identical figures.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Optional

from lightning_hpz import collectives
from lightning_hpz.planning.communication import ClusterLayout
from lightning_hpz.planning.tuning import LinkFigures

START_BYTES = 256 * 1024
MAX_BYTES = 64 * 2**20
TARGET_SECONDS = 0.15  # long enough that set-up costs and timer noise are small next to the transfer
REPEATS = 5
LATENCY_REPEATS = 5
PAGE_BYTES = 4096


@dataclass
class _Link:
    """One kind of link being measured: its groups' sizes, the message timed and the fastest time so far."""

    group: Any
    group_size: int
    latency: float
    size: int
    buffers: tuple[Any, Any]
    seconds: float = float("inf")

    @property
    def rate(self) -> float:
        """Bytes per second one rank sends."""
        return (self.group_size - 1) * self.size / self.seconds


def probe_links(layout: ClusterLayout, global_rank: int) -> LinkFigures:
    """Intra- and inter-node all-gather bandwidth and latency (a collective: every rank of the world calls it)."""
    start = time.perf_counter()
    nodes, devices = layout.nodes, layout.devices_per_node
    intra = _make_groups([[n * devices + i for i in range(devices)] for n in range(nodes)], devices > 1)
    inter = _make_groups([[n * devices + i for n in range(nodes)] for i in range(devices)], nodes > 1)
    try:
        inter_link = _sized(inter, nodes) if nodes > 1 else None
        intra_link = _sized(intra, devices) if devices > 1 else None
        _time_alternately([link for link in (inter_link, intra_link) if link is not None])
    finally:
        collectives.destroy_group(intra)
        collectives.destroy_group(inter)
    inter_rate = inter_latency = None
    if inter_link is not None:
        inter_latency, inter_rate = inter_link.latency, inter_link.rate * devices  # all local ranks sent at once
    if intra_link is not None:
        intra_latency, intra_rate = intra_link.latency, intra_link.rate
    else:  # no intra-node traffic exists; the figures are never used
        intra_latency, intra_rate = inter_latency or 0.0, inter_rate or 1.0
    elapsed = collectives.all_reduce_values([time.perf_counter() - start], op="max")[0]
    return LinkFigures(intra_rate, intra_latency, inter_rate, inter_latency, probe_seconds=elapsed)


def _make_groups(rank_lists: list[list[int]], needed: bool) -> Optional[Any]:
    # Every rank creates every group (torch requires it), also those it is not in.
    return collectives.new_subgroups(rank_lists) if needed else None


def _sized(group: Any, group_size: int) -> _Link:
    """The latency over ``group`` and the message size that takes about ``TARGET_SECONDS`` to all-gather."""
    _agreed_seconds(group, 1)  # the first collective on a group may set up connections
    latency = statistics.median(_agreed_seconds(group, 1) for _ in range(LATENCY_REPEATS))
    size = START_BYTES
    seconds = _agreed_seconds(group, size)
    while seconds < TARGET_SECONDS / 2 and size < MAX_BYTES:
        size *= 2
        seconds = _agreed_seconds(group, size)
    size = _sized_for_target(size, seconds)
    # written once: the repeats time only the transfers
    return _Link(group, group_size, latency, size, collectives.gather_buffers(size, group))


def _sized_for_target(size: int, seconds: float) -> int:
    # Scaled to take about TARGET_SECONDS at the rate just seen, rather than the next doubling's 1-2x of it: the
    # repeats then take a predictable time, and every run times transfers of about the same length.
    scaled = int(size * TARGET_SECONDS / max(seconds, 1e-9)) // PAGE_BYTES * PAGE_BYTES
    return min(MAX_BYTES, max(size, scaled))  # never below the size measured, which is at least START_BYTES


def _time_alternately(links: list[_Link]) -> None:
    # Alternating the kinds spreads each one's repeats over the whole probe: a slow spell of the machine (other work,
    # a descheduled rank) then costs one repeat of each rather than all repeats of one.
    for _ in range(REPEATS):
        for link in links:
            link.seconds = min(link.seconds, _agreed_seconds(link.group, link.size, link.buffers))


def _agreed_seconds(group: Any, size: int, buffers: Optional[tuple[Any, Any]] = None) -> float:
    return collectives.all_reduce_values([collectives.timed_all_gather(size, group, buffers)], op="max")[0]
