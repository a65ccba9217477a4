"""Configs as Lightning's DeepSpeedStrategy reads them: the env-variable file, ``zero_optimization=False``, its
exception class, activation-checkpointing settings. Only the last test launches a (single) process."""

import json

import lightning as L
import pytest
from conftest import run_script
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_hpz import HpzConfigurationError, HpzStrategy

STAGE_2 = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 1234}, "train_micro_batch_size_per_gpu": 2}


def _built(strategy: HpzStrategy, devices: int = 2) -> HpzStrategy:
    L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False)
    return strategy


@pytest.fixture
def env_config(tmp_path, monkeypatch):
    def write(config: dict):
        path = tmp_path / "ds_config.json"
        path.write_text(json.dumps(config))
        monkeypatch.setenv("PL_DEEPSPEED_CONFIG_PATH", str(path))
        return path

    return write


def test_env_config_keeps_its_stage(env_config):
    env_config(STAGE_2)
    strategy = _built(HpzStrategy())
    zero = strategy.config["zero_optimization"]
    assert zero["stage"] == 2 and zero["reduce_bucket_size"] == 1234
    assert "zero_hpz_partition_size" not in zero  # hpZ is a stage-3 setting: nothing injected
    assert strategy.config["train_micro_batch_size_per_gpu"] == 2
    assert not strategy.zero_stage_3


@pytest.mark.parametrize("config", [STAGE_2, {"train_micro_batch_size_per_gpu": 2}])
def test_env_config_reads_like_the_same_dict_given_as_config(env_config, monkeypatch, config):
    env_config(config)
    from_env = _built(HpzStrategy()).config
    monkeypatch.delenv("PL_DEEPSPEED_CONFIG_PATH")
    assert from_env == _built(HpzStrategy(config=config)).config


def test_config_argument_wins_over_env_config(env_config):
    env_config(STAGE_2)  # Lightning reads the variable only when no config= is given
    strategy = _built(HpzStrategy(config={"zero_optimization": {"stage": 1}}))
    assert strategy.config["zero_optimization"]["stage"] == 1
    assert strategy.config["zero_optimization"]["reduce_bucket_size"] == 200_000_000  # the default, not the file's


def test_env_config_conflicting_with_a_kwarg_is_refused(env_config):
    env_config(STAGE_2)
    with pytest.raises(HpzConfigurationError, match=r"stage=3 conflicts with zero_optimization.stage=2"):
        HpzStrategy(stage=3)


def test_missing_env_config_file_names_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("PL_DEEPSPEED_CONFIG_PATH", str(tmp_path / "gone.json"))
    with pytest.raises(HpzConfigurationError, match=r"PL_DEEPSPEED_CONFIG_PATH='.*gone.json': no such file"):
        HpzStrategy()


def test_zero_optimization_false_keeps_zero_off():
    # as Lightning's DeepSpeedStrategy: no zero_optimization section, DeepSpeed's plain data parallel
    strategy = _built(HpzStrategy(zero_optimization=False))
    assert "zero_optimization" not in strategy.config
    assert strategy.hpz_partition_size == 1
    assert not strategy.zero_stage_3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stage": 3}, r"zero_optimization=False turns ZeRO off, but stage=3 asks for ZeRO stage 3"),
        ({"config": STAGE_2}, r"but zero_optimization.stage in config=\=2"),
        ({"hpz_partition_size": 2}, r"hpz_partition_size=2 needs ZeRO stage 3"),
    ],
)
def test_zero_optimization_false_refuses_zero_settings(kwargs, message):
    with pytest.raises(HpzConfigurationError, match=message):
        HpzStrategy(zero_optimization=False, **kwargs)


def test_configuration_errors_are_lightnings_misconfiguration(tmp_path):
    # code written for Lightning's DeepSpeedStrategy catches MisconfigurationException here
    with pytest.raises(MisconfigurationException, match=r"no such file"):
        HpzStrategy(config=str(tmp_path / "missing.json"))
    assert issubclass(HpzConfigurationError, ValueError)


def test_contiguous_checkpointing_without_layer_count_is_refused():
    with pytest.raises(HpzConfigurationError, match=r"activation_checkpointing.number_checkpoints is None"):
        HpzStrategy(partition_activations=True, contiguous_memory_optimization=True)


def test_contiguous_checkpointing_without_partitioned_activations_is_refused():
    config = {"activation_checkpointing": {"number_checkpoints": 4}}
    with pytest.raises(HpzConfigurationError, match=r"needs partition_activations=True too"):
        HpzStrategy(contiguous_memory_optimization=True, config=config)


def test_contiguous_checkpointing_settings_reach_deepspeed(tmp_path):
    strategy = {
        "partition_activations": True,
        "contiguous_memory_optimization": True,
        "synchronize_checkpoint_boundary": True,
        "config": {"activation_checkpointing": {"number_checkpoints": 3}},
    }
    run = run_script("activation_checkpointing.py", {"strategy": strategy}, tmp_path / "out", timeout=180)
    assert run.returncode == 0, run.output[-3000:]
    expected = {"contiguous": True, "partition_activations": True, "layers": 3, "synchronize": True}
    assert run.ranks[0] == {**expected, "cpu_checkpointing": False}
