"""The communication estimate for the Trainer's strategy: its ZeRO setup, the cluster layout and the gloo/NCCL
difference, handed to :mod:`lightning_hpz.planning`.

* A DeepSpeed-based strategy (``HpzStrategy`` included): stage, ``zero_hpz_partition_size``, qwZ and qgZ from its
  DeepSpeed config. Whether ZeRO-3 re-gathers in backward is judged from ``stage3_max_live_parameters`` and
  ``stage3_max_reuse_distance`` against the model size (a model that fits under both stays gathered).
* DDP: stage 0 (one gradient all-reduce). FSDP full shard: stage 3 (parameters re-gathered in backward), grad-op
  shard: stage 2. Hybrid sharding and any other strategy: not modelled (None). One device: no traffic.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, SingleDeviceStrategy

from lightning_hpz.partitioning.sharded_parameters import full_element_count
from lightning_hpz.planning import ClusterLayout, TrafficEstimate, ZeroSetup, traffic_per_step

_DEEPSPEED_KEEP_DEFAULT = 1_000_000_000  # DeepSpeed's default stage3_max_live_parameters / max_reuse_distance


def full_parameter_count(module: torch.nn.Module) -> int:
    # Under ZeRO-3 a parameter holds only its shard: count whole parameters from their full shapes.
    return full_element_count(module)


def zero_setup_of(strategy: Any) -> Optional[ZeroSetup]:
    if isinstance(strategy, DeepSpeedStrategy):
        zero = strategy.config.get("zero_optimization", {})
        return ZeroSetup(
            stage=int(zero.get("stage", 0)),
            hpz_partition_size=int(zero.get("zero_hpz_partition_size", 1)),
            quantized_weights=bool(zero.get("zero_quantized_weights", False)),
            quantized_gradients=bool(zero.get("zero_quantized_gradients", False)),
        )
    if isinstance(strategy, FSDPStrategy):
        sharding = str(getattr(strategy, "sharding_strategy", "")).upper()
        return ZeroSetup(3) if "FULL_SHARD" in sharding else ZeroSetup(2) if "SHARD_GRAD_OP" in sharding else None
    if isinstance(strategy, DDPStrategy):
        return ZeroSetup(0)
    return None


def regathers_in_backward(strategy: Any, param_count: int) -> bool:
    if not isinstance(strategy, DeepSpeedStrategy):
        return True
    zero = strategy.config.get("zero_optimization", {})
    max_live = zero.get("stage3_max_live_parameters", _DEEPSPEED_KEEP_DEFAULT)
    max_reuse = zero.get("stage3_max_reuse_distance", _DEEPSPEED_KEEP_DEFAULT)
    return not (param_count <= max_live and param_count <= max_reuse)


def bytes_per_value(precision: str) -> int:
    return 2 if "16" in str(precision) else 8 if "64" in str(precision) else 4


def gradient_reduction() -> str:
    """gloo runs reduce-scatter as an all-reduce (see lightning_hpz.planning.communication)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return "all_reduce" if torch.distributed.get_backend() == "gloo" else "reduce_scatter"
    return "reduce_scatter"


def strategy_traffic(trainer: Trainer, module: torch.nn.Module) -> Optional[TrafficEstimate]:
    """Bytes per rank per optimizer step across and within nodes, or None where the strategy is not modelled."""
    if isinstance(trainer.strategy, SingleDeviceStrategy) or trainer.world_size == 1:
        return TrafficEstimate(0.0, 0.0)
    zero = zero_setup_of(trainer.strategy)
    if zero is None:
        return None
    params = full_parameter_count(module)
    value_bytes = bytes_per_value(trainer.precision)
    return traffic_per_step(
        params,
        zero,
        ClusterLayout(trainer.num_nodes, trainer.num_devices),
        param_bytes=value_bytes,
        grad_bytes=value_bytes,
        regather_in_backward=regathers_in_backward(trainer.strategy, params),
        gradient_reduction=gradient_reduction(),
    )
