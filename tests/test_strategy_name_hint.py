"""A mistyped strategy name on a Trainer or Fabric gets the closest lightning_hpz name in Lightning's own error."""

import lightning as L
import pytest
from lightning.fabric import Fabric

import lightning_hpz  # noqa: F401 - registers the names, and the hint with them
from lightning_hpz.strategy.name_hint import closest_package_name


def test_trainer_suggests_the_closest_package_name():
    with pytest.raises(ValueError, match=r"invalid strategy name: `strategy='hpzz'`.*Did you mean 'hpz'"):
        L.Trainer(strategy="hpzz", accelerator="cpu", devices=1, logger=False)


def test_fabric_suggests_the_closest_package_name():
    with pytest.raises(ValueError, match=r"invalid strategy name: `strategy='hpz_ofload'`.*Did you mean 'hpz_offload'"):
        Fabric(strategy="hpz_ofload", accelerator="cpu", devices=1)


def test_a_name_far_from_ours_keeps_lightnings_message():
    with pytest.raises(ValueError, match=r"invalid strategy name: `strategy='ddpx'`") as error:
        L.Trainer(strategy="ddpx", accelerator="cpu", devices=1, logger=False)
    assert "Did you mean" not in str(error.value)


def test_other_errors_of_the_check_are_untouched():
    with pytest.raises(ValueError, match=r"accelerator") as error:  # Lightning's own, raised by the same method
        L.Trainer(strategy="hpz", accelerator="cpuu", devices=1, logger=False)
    assert "Did you mean 'hpz'" not in str(error.value)


def test_closest_package_name():
    assert closest_package_name("ZERO_3") == "zero3"
    assert closest_package_name("fsdp") is None
