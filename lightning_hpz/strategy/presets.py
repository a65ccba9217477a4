"""The strategy names lightning_hpz registers: name, description, ``HpzStrategy`` arguments.

Plain data, no torch: ``lightning-hpz strategies`` and the name suggestions read it without importing Lightning.
"""

from __future__ import annotations

from typing import Any

STRATEGY_PRESETS: list[tuple[str, str, dict[str, Any]]] = [
    ("hpz", "ZeRO-3 + hpZ (secondary partition = devices per node), stabilized; CPU and GPU", {}),
    (
        "hpz_auto",
        "ZeRO-3 + hpZ, hpZ size and ZeRO-3 thresholds chosen from link measurements at start-up",
        {"autotune": True},
    ),
    (
        "hpz_offload",
        "ZeRO-3 + hpZ with optimizer states offloaded to CPU memory",
        {"offload_optimizer": True},
    ),
    (
        "zeropp",
        "full ZeRO++: ZeRO-3 + hpZ + qwZ (int8 weight gather) + qgZ (quantized gradients); CUDA only",
        {"quantized_weights": True, "quantized_gradients": True},
    ),
    ("zero1", "ZeRO stage 1 (optimizer states sharded); CPU and GPU", {"stage": 1, "hpz_partition_size": 1}),
    (
        "zero2",
        "ZeRO stage 2 (optimizer states + gradients sharded); CPU and GPU",
        {"stage": 2, "hpz_partition_size": 1},
    ),
    (
        "zero2_offload",
        "ZeRO stage 2 with optimizer states offloaded to CPU",
        {"stage": 2, "hpz_partition_size": 1, "offload_optimizer": True},
    ),
    ("zero3", "plain ZeRO stage 3 (everything sharded, hpZ off); CPU and GPU", {"stage": 3, "hpz_partition_size": 1}),
    (
        "zero3_offload",
        "plain ZeRO stage 3 with parameters and optimizer states offloaded to CPU",
        {"stage": 3, "hpz_partition_size": 1, "offload_optimizer": True, "offload_parameters": True},
    ),
]
