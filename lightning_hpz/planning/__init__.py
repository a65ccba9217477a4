"""Analytic communication and memory model of ZeRO stages, hpZ, qwZ and qgZ (shared by the throughput callback,
the bandwidth benchmark and ``lightning-hpz plan``)."""

from lightning_hpz.planning.communication import (
    GRADIENT_REDUCTIONS,
    ClusterLayout,
    TrafficEstimate,
    ZeroSetup,
    node_link_bytes,
    ring_traffic,
    traffic_per_step,
)
from lightning_hpz.planning.memory import MemoryEstimate, memory_per_rank

__all__ = [
    "GRADIENT_REDUCTIONS",
    "ClusterLayout",
    "MemoryEstimate",
    "TrafficEstimate",
    "ZeroSetup",
    "memory_per_rank",
    "node_link_bytes",
    "ring_traffic",
    "traffic_per_step",
]
