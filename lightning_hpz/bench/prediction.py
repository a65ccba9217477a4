"""The communication model's prediction for a benchmark configuration (``lightning_hpz.planning.communication``).

The PyTorch peers are predicted by the ZeRO setup with the same traffic pattern; FSDP2 HSDP and DeepSpeed MiCS as
ZeRO-3 sharded within a node and replicated across nodes (``ZeroSetup(3, shard_size=<devices per node>)``; see
:class:`~lightning_hpz.bench.configurations.BenchConfiguration`). The model is imported only when asked for, so the
benchmark still measures where it is missing; the prediction is then ``None`` with the reason.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

from lightning_hpz.bench.configurations import BenchConfiguration

FP32_BYTES = 4  # the benchmark trains in fp32 on CPU: parameters and gradients travel as 4-byte floats
# AdamW's bytes per parameter beyond the parameter itself: DeepSpeed keeps an fp32 master copy even in fp32 training
# (master, momentum, variance); torch's AdamW on FSDP2/DDP parameters only the two moments.
OPTIMIZER_BYTES = {"lightning": 12, "deepspeed": 12, "fsdp2": 8, "ddp": 8}
# torch's gloo backend runs a reduce-scatter as a full all-reduce (measured by the model's author, see its docstring).
GLOO_GRADIENT_REDUCTION = "all_reduce"


def predicted_cross_node_bytes(
    configuration: BenchConfiguration, parameter_count: int, devices_per_node: int
) -> tuple[Optional[float], str]:
    """(inter-node bytes per rank per step, how it was obtained)."""
    try:
        from lightning_hpz.planning.communication import ClusterLayout, ZeroSetup, traffic_per_step
    except ImportError as err:
        return None, f"no prediction: the communication model is not importable ({err})"
    setup = ZeroSetup(
        stage=configuration.zero_stage,
        hpz_partition_size=configuration.hpz_partition_size(devices_per_node),
        shard_size=configuration.shard_size(devices_per_node),
    )
    options: dict[str, Any] = {"param_bytes": FP32_BYTES, "grad_bytes": FP32_BYTES, "regather_in_backward": True}
    if "gradient_reduction" in inspect.signature(traffic_per_step).parameters:
        options["gradient_reduction"] = GLOO_GRADIENT_REDUCTION
    layout = ClusterLayout(nodes=2, devices_per_node=devices_per_node)
    estimate = traffic_per_step(parameter_count, setup, layout, **options)
    described = ", ".join(f"{key}={value!r}" for key, value in options.items())
    return float(estimate.inter_node_bytes), f"traffic_per_step({setup}, {layout}, {described})"


def predicted_model_state_bytes(
    configuration: BenchConfiguration, parameter_count: int, devices_per_node: int
) -> float:
    """Model-state bytes one rank holds at the optimizer step (``lightning_hpz.planning.memory``): parameters,
    gradients, optimizer states, hpZ's secondary shard; activations and buffers not included."""
    from lightning_hpz.planning.communication import ClusterLayout, ZeroSetup
    from lightning_hpz.planning.memory import memory_per_rank

    setup = ZeroSetup(
        stage=configuration.zero_stage,
        hpz_partition_size=configuration.hpz_partition_size(devices_per_node),
        shard_size=configuration.shard_size(devices_per_node),
    )
    layout = ClusterLayout(nodes=2, devices_per_node=devices_per_node)
    estimate = memory_per_rank(
        parameter_count,
        setup,
        layout,
        param_bytes=FP32_BYTES,
        grad_bytes=FP32_BYTES,
        optimizer_bytes_per_param=OPTIMIZER_BYTES[configuration.driver],
    )
    return estimate.total
