"""Every bad setting is refused with a message naming the value and the fix, while the Trainer is built.

Nothing here launches a process: an error at `Trainer(...)` is raised before any rank could wait for another.
"""

import json
import re

import lightning as L
import pytest

import lightning_hpz
from lightning_hpz import HpzConfigurationError, HpzStrategy


def _trainer(strategy, devices=4, num_nodes=1):
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, num_nodes=num_nodes, logger=False)


def test_hpz_needs_stage_3():
    with pytest.raises(HpzConfigurationError, match=r"hpz_partition_size=2 needs ZeRO stage 3.*stage=2.*Use stage=3"):
        HpzStrategy(stage=2, hpz_partition_size=2)


@pytest.mark.parametrize("size", [0, -2, 1.5, "two", True])
def test_partition_size_must_be_positive_int_or_auto(size):
    with pytest.raises(HpzConfigurationError, match=r"hpz_partition_size="):
        HpzStrategy(hpz_partition_size=size)


def test_partition_size_must_divide_world_size():
    with pytest.raises(HpzConfigurationError, match=r"hpz_partition_size=3 does not divide the world size 4"):
        _trainer(HpzStrategy(hpz_partition_size=3))


def test_partition_size_must_divide_devices_per_node():
    # 2 nodes x 2 devices: 4 divides the world size but a group of 4 would straddle both nodes
    with pytest.raises(HpzConfigurationError, match=r"not a divisor of the 2 devices per node.*span two nodes"):
        _trainer(HpzStrategy(hpz_partition_size=4), devices=2, num_nodes=2)


@pytest.mark.parametrize("flag", ["quantized_weights", "quantized_gradients"])
def test_quantization_refused_on_cpu(flag):
    with pytest.raises(HpzConfigurationError, match=rf"{flag}=True .* needs CUDA.*CPUAccelerator.*Set {flag}=False"):
        _trainer(HpzStrategy(**{flag: True}))


def test_registered_zeropp_refused_on_cpu():
    with pytest.raises(HpzConfigurationError, match=r"needs CUDA"):
        _trainer("zeropp")


def test_quantization_needs_stage_3():
    with pytest.raises(HpzConfigurationError, match=r"quantized_weights=True \(ZeRO\+\+\) needs stage=3"):
        HpzStrategy(stage=2, quantized_weights=True)


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(HpzConfigurationError, match=r"nope.json.*no such file"):
        HpzStrategy(config=str(missing))


def test_config_file_not_json(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text('{"zero_optimization": {"stage": 3,}}')
    with pytest.raises(HpzConfigurationError, match=r"ds.json.*is not valid JSON.*line 1"):
        HpzStrategy(config=str(bad))


def test_config_file_not_an_object(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text("[1, 2]")
    with pytest.raises(HpzConfigurationError, match=r"holds a list; it must be a JSON object"):
        HpzStrategy(config=str(bad))


def test_kwarg_conflicting_with_config_is_refused():
    config = {"zero_optimization": {"stage": 2}}
    with pytest.raises(HpzConfigurationError, match=r"stage=3 conflicts with zero_optimization.stage=2.*one place"):
        HpzStrategy(stage=3, config=config)


def test_hpz_size_conflicting_with_config_is_refused():
    config = {"zero_optimization": {"zero_hpz_partition_size": 4}}
    with pytest.raises(HpzConfigurationError, match=r"hpz_partition_size=2 conflicts with .*zero_hpz_partition_size=4"):
        HpzStrategy(hpz_partition_size=2, config=config)


def test_unknown_sync_mode():
    with pytest.raises(HpzConfigurationError, match=r"hpz_sync='fast' is not a mode; choose one of"):
        HpzStrategy(hpz_sync="fast")


def test_stage_out_of_range():
    with pytest.raises(HpzConfigurationError, match=r"stage=4 is not a ZeRO stage; use 1, 2 or 3"):
        HpzStrategy(stage=4)


def test_agreeing_values_in_both_places_are_accepted(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}))
    strategy = HpzStrategy(stage=3, hpz_partition_size=2, config=str(path))
    _trainer(strategy)
    assert strategy.config["zero_optimization"]["zero_hpz_partition_size"] == 2


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"checkpoint": {"writer": {"decoupled": True}}}, "checkpoint.writer.decoupled=True"),
        ({"datastates_ckpt": {}}, "datastates_ckpt enables DataStates"),
    ],
)
@pytest.mark.parametrize("strategy_class", [lightning_hpz.HpzStrategy, lightning_hpz.HpzFabricStrategy])
def test_asynchronous_checkpoint_writers_are_refused(strategy_class, config, message):
    # the commit (checksums, manifest, replacing the previous copy) runs when the save returns: the files must be done
    with pytest.raises(HpzConfigurationError, match=re.escape(message)):
        strategy_class(config=config)


def test_the_synchronous_fast_writer_is_accepted():
    strategy = lightning_hpz.HpzStrategy(config={"checkpoint": {"writer": {"decoupled": False}}})
    assert strategy.config["checkpoint"]["writer"]["decoupled"] is False
