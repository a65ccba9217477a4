"""Stabilized hierarchical partitioning: the only package that touches DeepSpeed internals.

Importing it does not import DeepSpeed: the names below that need DeepSpeed load their module (which checks the
installed DeepSpeed) on first use, so code that only reads ``ds_*`` attributes works without DeepSpeed installed.
"""

from __future__ import annotations

import os

import torch

# Without a GPU, tell DeepSpeed so before it is imported: it then skips probing for one (and warning about it).
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

from lightning_hpz.lazy_names import lazy_names
from lightning_hpz.partitioning.emulation import EMULATION_ENV_VAR, emulation_requested
from lightning_hpz.partitioning.ordering import SYNC_MODES, CopyOrdering

# name -> the module that defines it (imported, with DeepSpeed, on first access)
_NEEDS_DEEPSPEED = {
    "IncompatibleDeepSpeedError": "deepspeed_patch",
    "install": "deepspeed_patch",
    "uninstall": "deepspeed_patch",
    "ConvertedParameters": "converted_parameters",
    "order_converted_parameters": "converted_parameters",
    "SecondaryCheckReport": "secondary_partitions",
    "SecondaryPartitionMismatchError": "secondary_partitions",
    "check_secondary_partitions": "secondary_partitions",
    "count_secondary_partitions": "secondary_partitions",
    "refresh_secondary_partitions": "secondary_partitions",
    "prepare_cpu_comm_op": "cpu_comm_op",
    "CpuAdamBuildError": "cpu_adam_op",
    "offloads_to_cpu_adam": "cpu_adam_op",
    "prepare_cpu_adam_op": "cpu_adam_op",
    "snapshot_loss_scale": "loss_scale_state",
    "restore_loss_scale": "loss_scale_state",
    "ensure_hpz_groups": "inference_engine",
    "optimizer_less_checkpoint_load": "inference_engine",
    "clipped_step": "step_clipping",
    "clipping_optimizer": "step_clipping",
    "write_step_norm": "step_clipping",
    "request_loop_owned_accumulation": "loop_owned_accumulation",
    "loop_owns_accumulation": "loop_owned_accumulation",
    "loop_owned_accumulation_available": "loop_owned_accumulation",
    "refresh_master_weights": "master_weights",
    "OpenWrites": "placeholder_writes",
    "loads_reach_shards": "placeholder_writes",
    "registered_parameters": "placeholder_writes",
    "writes_reach_shards": "placeholder_writes",
    "VerifiedReads": "verified_reads",
    "verifying_reads": "verified_reads",
    "HashedWrites": "hashed_writes",
    "hashing_writes": "hashed_writes",
}

__getattr__, __dir__ = lazy_names(__name__, _NEEDS_DEEPSPEED)


__all__ = ["EMULATION_ENV_VAR", "SYNC_MODES", "CopyOrdering", "emulation_requested", *_NEEDS_DEEPSPEED]
