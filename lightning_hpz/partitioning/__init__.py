"""Stabilized hierarchical partitioning: the only package that touches DeepSpeed internals."""

import os

import torch

# Without a GPU, tell DeepSpeed so before it is imported: it then skips probing for one (and warning about it).
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

from lightning_hpz.partitioning.cpu_comm_op import prepare_cpu_comm_op
from lightning_hpz.partitioning.deepspeed_patch import IncompatibleDeepSpeedError, install, uninstall
from lightning_hpz.partitioning.emulation import EMULATION_ENV_VAR, emulation_requested
from lightning_hpz.partitioning.inference_engine import ensure_hpz_groups, optimizer_less_checkpoint_load
from lightning_hpz.partitioning.ordering import SYNC_MODES, CopyOrdering
from lightning_hpz.partitioning.secondary_partitions import (
    SecondaryCheckReport,
    SecondaryPartitionMismatchError,
    check_secondary_partitions,
    count_secondary_partitions,
    refresh_secondary_partitions,
)

__all__ = [
    "EMULATION_ENV_VAR",
    "SYNC_MODES",
    "CopyOrdering",
    "IncompatibleDeepSpeedError",
    "SecondaryCheckReport",
    "SecondaryPartitionMismatchError",
    "check_secondary_partitions",
    "count_secondary_partitions",
    "emulation_requested",
    "ensure_hpz_groups",
    "install",
    "optimizer_less_checkpoint_load",
    "prepare_cpu_comm_op",
    "refresh_secondary_partitions",
    "uninstall",
]
