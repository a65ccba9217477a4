"""The DeepSpeed patch refuses, with the install command, a DeepSpeed it was not built for."""

import deepspeed
import pytest
from deepspeed.runtime.zero import partition_parameters

from lightning_hpz.partitioning import deepspeed_patch
from lightning_hpz.partitioning.deepspeed_patch import IncompatibleDeepSpeedError


def test_installed_deepspeed_passes():
    assert deepspeed_patch._check_installed_deepspeed() is partition_parameters


@pytest.mark.parametrize("version", ["0.15.4", "0.16.8", "0.20.0", "1.0.0"])
def test_untested_version_is_refused(monkeypatch, version):
    monkeypatch.setattr(deepspeed, "__version__", version)
    with pytest.raises(IncompatibleDeepSpeedError, match=rf"DeepSpeed {version} is outside .*pip install 'deepspeed>="):
        deepspeed_patch._check_installed_deepspeed()


def test_missing_target_is_refused(monkeypatch):
    monkeypatch.delattr(partition_parameters.Init, "_partition_param_sec")
    with pytest.raises(IncompatibleDeepSpeedError, match=r"has no `Init._partition_param_sec.*order hpZ secondary"):
        deepspeed_patch._check_installed_deepspeed()


def test_changed_signature_is_refused(monkeypatch):
    monkeypatch.setattr(partition_parameters.Init, "_convert_to_deepspeed_param", lambda self, tensor, extra: None)
    with pytest.raises(IncompatibleDeepSpeedError, match=r"_convert_to_deepspeed_param"):
        deepspeed_patch._check_installed_deepspeed()


def test_wrappers_are_in_place_only_while_installed():
    original = partition_parameters.Init._partition_param_sec
    assert original is deepspeed_patch._ORIGINAL_PARTITION_PARAM_SEC  # importing the patch patches nothing
    deepspeed_patch.install("event")
    try:
        assert partition_parameters.Init._partition_param_sec is deepspeed_patch._ordered_partition_param_sec
        assert partition_parameters.Init._convert_to_deepspeed_param is deepspeed_patch._convert_with_ordered_gather
    finally:
        deepspeed_patch.uninstall()
    # DeepSpeed's own again, with the fixes of its release's hpZ bugs (the very same function from 0.19.5 on)
    assert partition_parameters.Init._partition_param_sec is deepspeed_patch._STOCK_PARTITION_PARAM_SEC


def test_a_stale_owner_does_not_uninstall_a_newer_ordering():
    first = deepspeed_patch.install("event")
    second = deepspeed_patch.install("stream")
    try:
        deepspeed_patch.uninstall(first)
        assert deepspeed_patch.active_ordering() is second and deepspeed_patch.is_wrapped()
    finally:
        deepspeed_patch.uninstall(second)
    assert deepspeed_patch.active_ordering() is None and not deepspeed_patch.is_wrapped()
