"""Callbacks for any Lightning project: token throughput (with communication estimates), loss stability, and the
integrity of hpZ secondary partitions."""

from lightning_hpz.callbacks.batch_tokens import BatchTokens
from lightning_hpz.callbacks.loss_stability_monitor import LossStabilityMonitor, UpdateNotSkippedError
from lightning_hpz.callbacks.secondary_partition_check import SecondaryPartitionCheck
from lightning_hpz.callbacks.token_throughput_monitor import TokenThroughputMonitor
from lightning_hpz.lifecycle.preemption_checkpoint import PreemptionCheckpoint  # lives with the run's lifecycle

__all__ = [
    "BatchTokens",
    "LossStabilityMonitor",
    "PreemptionCheckpoint",
    "SecondaryPartitionCheck",
    "TokenThroughputMonitor",
    "UpdateNotSkippedError",
]
