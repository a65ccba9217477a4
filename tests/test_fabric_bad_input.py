"""``Fabric(strategy=...)`` refuses every bad setting the Trainer refuses, with the very same message, before launch.

Each case is built both ways, as ``Trainer(strategy=HpzStrategy(...))`` and as
``Fabric(strategy=HpzFabricStrategy(...))`` (or by registered name in both registries), and the errors are compared.
Nothing here launches a process.
"""

import json

import lightning as L
import pytest

from lightning_hpz import HpzConfigurationError, HpzFabricStrategy, HpzStrategy

BAD_SETTINGS = {
    "hpz below stage 3": dict(stage=2, hpz_partition_size=2),
    "zero partition size": dict(hpz_partition_size=0),
    "fractional partition size": dict(hpz_partition_size=1.5),
    "partition size as word": dict(hpz_partition_size="two"),
    "bool partition size": dict(hpz_partition_size=True),
    "stage out of range": dict(stage=4),
    "qwZ below stage 3": dict(stage=2, quantized_weights=True),
    "unknown sync mode": dict(hpz_sync="fast"),
    "kwarg conflicting with config": dict(stage=3, config={"zero_optimization": {"stage": 2}}),
    "size does not divide world": dict(hpz_partition_size=3),
    "qwZ on CPU": dict(quantized_weights=True),
    "qgZ on CPU": dict(quantized_gradients=True),
}
BAD_LAYOUTS = {
    # 2 nodes x 2 devices: 4 divides the world size, but a group of 4 would straddle both nodes
    "group spans nodes": (dict(hpz_partition_size=4), dict(devices=2, num_nodes=2)),
}


def _refusal(build) -> HpzConfigurationError:
    with pytest.raises(HpzConfigurationError) as caught:
        build()
    return caught.value


def _both_refusals(strategy_kwargs: dict, trainer_strategy=None, fabric_strategy=None, devices=4, num_nodes=1):
    layout = dict(accelerator="cpu", devices=devices, num_nodes=num_nodes)
    trainer = _refusal(
        lambda: L.Trainer(strategy=trainer_strategy or HpzStrategy(**strategy_kwargs), logger=False, **layout)
    )
    fabric = _refusal(lambda: L.Fabric(strategy=fabric_strategy or HpzFabricStrategy(**strategy_kwargs), **layout))
    return trainer, fabric


@pytest.mark.parametrize("case", sorted(BAD_SETTINGS))
def test_same_refusal_as_the_trainer(case):
    trainer, fabric = _both_refusals(BAD_SETTINGS[case])
    assert type(fabric) is type(trainer)
    assert str(fabric) == str(trainer)


def test_same_refusal_for_a_layout_across_nodes():
    kwargs, layout = BAD_LAYOUTS["group spans nodes"]
    trainer, fabric = _both_refusals(kwargs, **layout)
    assert str(fabric) == str(trainer)
    assert "span two nodes" in str(fabric)


def test_same_refusal_for_a_registered_name():
    # "zeropp" asks for qwZ and qgZ, which have no CPU kernels: refused from either registry
    trainer, fabric = _both_refusals({}, trainer_strategy="zeropp", fabric_strategy="zeropp")
    assert str(fabric) == str(trainer)
    assert "needs CUDA" in str(fabric)


@pytest.mark.parametrize("contents", ['{"zero_optimization": {"stage": 3,}}', "[1, 2]"])
def test_same_refusal_for_a_bad_config_file(tmp_path, contents):
    path = tmp_path / "ds.json"
    path.write_text(contents)
    assert str(_refusal(lambda: HpzFabricStrategy(config=str(path)))) == str(
        _refusal(lambda: HpzStrategy(config=str(path)))
    )


def test_registered_names_resolve_to_the_same_zero_settings(tmp_path):
    # the zero_optimization keys lightning_hpz owns come out the same for every name and argument
    for name in ("hpz", "zero1", "zero2", "zero3", "hpz_offload"):
        trainer = L.Trainer(strategy=name, accelerator="cpu", devices=4, logger=False)
        fabric = L.Fabric(strategy=name, accelerator="cpu", devices=4)
        assert isinstance(fabric.strategy, HpzFabricStrategy)
        assert fabric.strategy.config["zero_optimization"] == trainer.strategy.config["zero_optimization"], name
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"zero_hpz_partition_size": 2, "reduce_bucket_size": 7}}))
    fabric = L.Fabric(strategy=HpzFabricStrategy(config=str(path)), accelerator="cpu", devices=4)
    zero = fabric.strategy.config["zero_optimization"]
    assert (zero["zero_hpz_partition_size"], zero["reduce_bucket_size"], zero["overlap_comm"]) == (2, 7, True)
