"""The DeepSpeed config of an engine built for ``validate``, ``test`` and ``predict`` (no optimizer)."""

from __future__ import annotations

from typing import Any


def inference_config(training_config: dict[str, Any]) -> dict[str, Any]:
    """The part of the training config an inference engine needs, as Lightning's ``DeepSpeedStrategy`` selects it.

    Precision, and for ZeRO-3 the ``zero_optimization`` section (hpZ included), so the engine gathers partitioned
    parameters; ZeRO-1/2 shard only optimizer state and gradients, so their engines run without ZeRO.
    """
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}  # DeepSpeed's throughput timers need a value
    for precision in ("fp16", "bf16"):
        if precision in training_config:
            config[precision] = training_config[precision]
    zero = training_config.get("zero_optimization")
    if isinstance(zero, dict) and zero.get("stage") == 3:
        config["zero_optimization"] = zero
        config["zero_allow_untested_optimizer"] = training_config.get("zero_allow_untested_optimizer", True)
    return config
