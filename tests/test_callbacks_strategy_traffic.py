"""How the throughput monitor reads the ZeRO setup from a strategy, without launching anything."""

from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

from lightning_hpz.callbacks.strategy_traffic import bytes_per_value, regathers_in_backward, zero_setup_of
from lightning_hpz.planning import ZeroSetup


def deepspeed_strategy(**zero) -> DeepSpeedStrategy:
    return DeepSpeedStrategy(config={"zero_optimization": zero})


def test_zero_setup_from_deepspeed_config():
    strategy = deepspeed_strategy(stage=3, zero_hpz_partition_size=8, zero_quantized_weights=True)
    assert zero_setup_of(strategy) == ZeroSetup(3, 8, quantized_weights=True)
    assert zero_setup_of(deepspeed_strategy(stage=2)) == ZeroSetup(2)
    assert zero_setup_of(DDPStrategy()) == ZeroSetup(0)


def test_regather_follows_deepspeed_live_parameter_thresholds():
    defaults = deepspeed_strategy(stage=3)  # DeepSpeed keeps up to 1e9 parameters gathered
    assert not regathers_in_backward(defaults, 10_000_000)
    assert regathers_in_backward(defaults, 7_000_000_000)
    released = deepspeed_strategy(stage=3, stage3_max_live_parameters=0, stage3_max_reuse_distance=0)
    assert regathers_in_backward(released, 10_000)


def test_bytes_per_value_from_precision():
    assert [bytes_per_value(p) for p in ("bf16-mixed", "16-mixed", "32-true", "64-true")] == [2, 2, 4, 8]
