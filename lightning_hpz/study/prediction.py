"""The planner's (:mod:`lightning_hpz.planning`) memory per rank for a cell, in the bytes the cell trains with."""

from __future__ import annotations

from typing import Any

from lightning_hpz.planning import ClusterLayout, ZeroSetup, memory_per_rank
from lightning_hpz.study.cell_strategy import offloads_optimizer, offloads_parameters, zero_stage
from lightning_hpz.study.grid import StudyCell
from lightning_hpz.study.study_config import StudyConfig

# Bytes per parameter (and per gradient) as DeepSpeed holds them: the training dtype. Mixed precision keeps an fp32
# master copy in the optimizer states, and so does fp32 training (DeepSpeed's ZeRO optimizers clone the partition).
PARAM_BYTES = {"32-true": 4, "bf16-mixed": 2, "16-mixed": 2}
ADAM_BYTES_PER_PARAM = 12  # fp32 master weights + momentum + variance


def predicted_memory(cell: StudyCell, config: StudyConfig, param_count: int) -> dict[str, Any]:
    """Model states one rank holds on its device (``device_bytes``) and in host memory because of offloading.

    On a CPU accelerator the device is host memory, so offloading moves nothing and everything counts.
    """
    width = PARAM_BYTES[cell.precision]
    bucket = reduce_bucket_elements(config)
    estimate = memory_per_rank(
        param_count,
        ZeroSetup(zero_stage(cell.strategy), cell.hpz_partition_size),
        ClusterLayout(config.nodes, config.devices_per_node),
        param_bytes=width,
        optimizer_bytes_per_param=ADAM_BYTES_PER_PARAM,
        grad_bytes=width,
        # A CPU's resident set holds only the bucket pages gradients were written to: at most one model's worth.
        reduce_bucket_elements=min(bucket, param_count) if config.accelerator == "cpu" else bucket,
    )
    parts = {
        "parameters": estimate.parameters,
        "gradients": estimate.gradients,
        "optimizer_states": estimate.optimizer_states,
        "secondary_shards": estimate.secondary_shards,
        "reduce_buckets": estimate.reduce_buckets,
    }
    offloaded = _offloaded_parts(cell, config)
    return {
        "device_bytes": sum(v for k, v in parts.items() if k not in offloaded),
        "between_steps_bytes": sum(v for k, v in parts.items() if k not in offloaded) - estimate.freed_after_step,
        "host_bytes": sum(v for k, v in parts.items() if k in offloaded),
        **{f"{k}_bytes": v for k, v in parts.items()},
    }


def reduce_bucket_elements(config: StudyConfig) -> float:
    """``reduce_bucket_size`` of the cells: the study's DeepSpeed config, else Lightning's DeepSpeedStrategy default."""
    zero = config.deepspeed_config.get("zero_optimization", {})
    if "reduce_bucket_size" in zero:
        return float(zero["reduce_bucket_size"])
    import inspect

    from lightning.pytorch.strategies import DeepSpeedStrategy

    return float(inspect.signature(DeepSpeedStrategy.__init__).parameters["reduce_bucket_size"].default)


def _offloaded_parts(cell: StudyCell, config: StudyConfig) -> set[str]:
    if config.accelerator == "cpu":
        return set()
    parts = {"optimizer_states"} if offloads_optimizer(cell.strategy) else set()
    return parts | ({"parameters"} if offloads_parameters(cell.strategy) else set())
