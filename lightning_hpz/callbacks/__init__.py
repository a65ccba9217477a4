"""Callbacks for any Lightning project: token throughput (with communication estimates), loss stability, and the
integrity of hpZ secondary partitions."""

from lightning_hpz.callbacks.batch_tokens import BatchTokens
from lightning_hpz.callbacks.loss_stability_monitor import LossStabilityMonitor, UpdateNotSkippedError
from lightning_hpz.callbacks.preemption_checkpoint import PreemptionCheckpoint
from lightning_hpz.callbacks.secondary_partition_check import SecondaryPartitionCheck
from lightning_hpz.callbacks.token_throughput_monitor import TokenThroughputMonitor

__all__ = [
    "BatchTokens",
    "LossStabilityMonitor",
    "PreemptionCheckpoint",
    "SecondaryPartitionCheck",
    "TokenThroughputMonitor",
    "UpdateNotSkippedError",
]
