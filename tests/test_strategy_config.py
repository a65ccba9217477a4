"""How HpzStrategy builds its DeepSpeed config and how it is found by name (no process launched)."""

import subprocess
import sys

import lightning as L
import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lightning_hpz
from lightning_hpz import HpzStrategy
from lightning_hpz.strategy.config import merge_configs


def _trainer(strategy, devices=4, num_nodes=1):
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, num_nodes=num_nodes, logger=False)


def test_user_config_is_merged_over_defaults():
    strategy = HpzStrategy(hpz_partition_size=2, config={"zero_optimization": {"reduce_bucket_size": 1234}})
    _trainer(strategy)
    zero = strategy.config["zero_optimization"]
    assert zero["reduce_bucket_size"] == 1234  # the user's value
    assert zero["allgather_bucket_size"] == 200_000_000  # Lightning's default survives
    assert zero["zero_hpz_partition_size"] == 2 and zero["stage"] == 3
    assert "activation_checkpointing" in strategy.config


def test_merge_is_deep_and_does_not_mutate_inputs():
    defaults = {"a": {"b": 1, "c": 2}, "d": 3}
    override = {"a": {"c": 20}, "e": 5}
    assert merge_configs(defaults, override) == {"a": {"b": 1, "c": 20}, "d": 3, "e": 5}
    assert defaults == {"a": {"b": 1, "c": 2}, "d": 3}


def test_auto_size_is_devices_per_node_on_several_nodes():
    strategy = HpzStrategy()
    _trainer(strategy, devices=2, num_nodes=2)
    assert strategy.hpz_partition_size == 2


def test_auto_size_turns_hpz_off_on_one_node(caplog):
    strategy = HpzStrategy()
    _trainer(strategy, devices=4)
    assert strategy.hpz_partition_size == 1


def test_other_deepspeed_arguments_pass_through():
    strategy = HpzStrategy(stage=2, offload_optimizer=True, allgather_bucket_size=5)
    zero = strategy.config["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["allgather_bucket_size"] == 5


@pytest.mark.parametrize(
    ("name", "stage", "hpz_size"),
    [("hpz", 3, 1), ("zero1", 1, None), ("zero2", 2, None), ("zero3", 3, 1), ("hpz_offload", 3, 1)],
)
def test_registered_names_build_the_right_strategy(name, stage, hpz_size):
    trainer = _trainer(name)
    strategy = trainer.strategy
    assert isinstance(strategy, HpzStrategy)
    assert strategy.config["zero_optimization"]["stage"] == stage
    assert strategy.config["zero_optimization"].get("zero_hpz_partition_size") == hpz_size


def test_every_preset_is_registered_with_a_description():
    for name, description, _ in lightning_hpz.STRATEGY_PRESETS:
        assert name in StrategyRegistry
        assert StrategyRegistry[name]["description"] == description


def test_importing_again_does_not_fail():
    # in a fresh interpreter, so that reloading does not swap classes under the other tests
    code = (
        "import importlib, lightning_hpz, lightning_hpz.strategy.trainer_strategy\n"
        "importlib.reload(lightning_hpz.strategy.trainer_strategy); importlib.reload(lightning_hpz)\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "print('hpz' in StrategyRegistry)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "True"


def test_cli_lists_strategies():
    result = subprocess.run(
        [sys.executable, "-m", "lightning_hpz.cli", "strategies"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    names = [line.split()[0] for line in result.stdout.strip().splitlines()]
    assert names == [name for name, _, _ in lightning_hpz.STRATEGY_PRESETS]


def test_registry_entries_are_the_strategy_classes():
    # Lightning's registry contract: the entry's "strategy" is the class, and code checks it with issubclass
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import DeepSpeedStrategy

    for name, _, _ in lightning_hpz.STRATEGY_PRESETS:
        assert StrategyRegistry[name]["strategy"] is HpzStrategy, name
        assert issubclass(StrategyRegistry[name]["strategy"], DeepSpeedStrategy)
        assert STRATEGY_REGISTRY[name]["strategy"] is lightning_hpz.HpzFabricStrategy, name
        assert StrategyRegistry.get(name).preset_name == name
        assert STRATEGY_REGISTRY.get(name).preset_name == name
