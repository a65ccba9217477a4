"""DeepSpeed's hpZ/ZeRO++ bugs that users meet, each fixed in the package's DeepSpeed patch for the releases that have
it, or refused by name while the strategy is built (docs/versions.md lists them all and where each is tested).

Nothing here launches a process. The multi-process proofs are the version subset (``make test-versions``): the
one-output toy under hpZ on every supported DeepSpeed (#6659), writes under ``GatheredParameters``
(tests/test_secondary_partitions.py, #7606/#7130) and the sequential gather under the race emulation
(tests/test_race_emulation.py).
"""

from unittest import mock

import lightning as L
import pytest
import torch
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from packaging.version import Version

from lightning_hpz import HpzConfigurationError, HpzStrategy
from lightning_hpz.partitioning.deepspeed_patch import _stock_partition_param_sec
from lightning_hpz.strategy.config import validate_qwz_precision


class SecondaryLayout:
    """What ``Init._partition_param_sec`` reads of its ``Init``: 4 ranks, secondary groups of 2, this rank's place."""

    num_ranks_in_param_group = 2

    def __init__(self, rank_in_group: int) -> None:
        self.rank_in_group = rank_in_group

    def _aligned_size(self, param) -> int:
        return param.ds_numel + (-param.ds_numel) % 4


def stock_before_0_19_5(self, param, buffer=None, has_been_updated=False):
    """DeepSpeed's slice arithmetic of ``_partition_param_sec`` before PR #8210 (0.16.0 to 0.19.4)."""
    if param.ds_secondary_tensor is not None and not has_been_updated:
        return
    size = self._aligned_size(param) // self.num_ranks_in_param_group
    start = size * self.rank_in_group
    if param.ds_secondary_tensor is None:
        param.ds_secondary_tensor = torch.full((size,), float("nan"))
    copied = max(0, min(param.ds_numel - start, size))
    flat = param.contiguous().view(-1)
    param.ds_secondary_tensor.narrow(0, 0, copied).copy_(flat.narrow(0, start, copied))


def one_element_bias(value: float = 3.0) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.tensor([value]))
    param.ds_numel, param.ds_status, param.ds_secondary_tensor = 1, ZeroParamStatus.AVAILABLE, None
    return param


def test_the_stock_slice_arithmetic_crashes_on_a_one_element_bias():
    with pytest.raises(IndexError, match="start out of range"):  # DeepSpeed #6659, as users see it
        stock_before_0_19_5(SecondaryLayout(rank_in_group=1), one_element_bias())


@pytest.mark.parametrize("version", ["0.16.9", "0.17.6", "0.18.9", "0.19.4"])
def test_the_patch_fixes_it_before_0_19_5(version):
    fixed = _stock_partition_param_sec(stock_before_0_19_5, Version(version))
    holder, empty = one_element_bias(), one_element_bias()
    fixed(SecondaryLayout(rank_in_group=0), holder)
    fixed(SecondaryLayout(rank_in_group=1), empty)
    assert holder.ds_secondary_tensor[0] == 3.0  # the rank whose slice holds the element copied it
    assert torch.equal(empty.ds_secondary_tensor, torch.zeros(2))  # the other holds padding only, zeroed
    assert empty.shape == (1,) and empty.item() == 3.0  # the parameter is left as it was


def test_fixed_releases_run_deepspeed_unchanged():
    assert _stock_partition_param_sec(stock_before_0_19_5, Version("0.19.5")) is stock_before_0_19_5


@pytest.mark.parametrize(("version", "rewritten"), [("0.16.9", True), ("0.18.2", True), ("0.18.3", False)])
def test_a_written_parameter_refreshes_its_secondary_before_0_18_3(version, rewritten):
    # DeepSpeed #7606 (fixed by #7707 in 0.18.3): `Init._partition` did not pass has_been_updated on, so the release
    # after a write under GatheredParameters(modifier_rank=...) kept the old secondary copy
    write = _stock_partition_param_sec(stock_before_0_19_5, Version(version))
    param = one_element_bias()
    write(SecondaryLayout(rank_in_group=0), param)
    with torch.no_grad():
        param.fill_(5.0)
    write(SecondaryLayout(rank_in_group=0), param)  # as DeepSpeed 0.16-0.18.2 calls it: has_been_updated=False
    assert param.ds_secondary_tensor[0] == (5.0 if rewritten else 3.0)


def cpu_trainer(**strategy_kwargs) -> L.Trainer:
    return L.Trainer(strategy=HpzStrategy(**strategy_kwargs), accelerator="cpu", devices=4, logger=False)


def test_hpz_under_mics_is_refused():
    # MiCS returns its own optimizer before hpZ's groups are built: hpZ would be silently off
    with pytest.raises(HpzConfigurationError, match=r"MiCS .*mics_shard_size=2.*hpz_partition_size=1"):
        cpu_trainer(hpz_partition_size=2, config={"zero_optimization": {"mics_shard_size": 2}})


def test_hpz_under_autoep_is_refused():
    with pytest.raises(HpzConfigurationError, match=r"AutoEP .*hpz_partition_size=1"):
        cpu_trainer(hpz_partition_size=2, config={"expert_parallel": {"enabled": True}})


def test_mics_and_autoep_without_hpz_are_left_to_deepspeed():
    for config in ({"zero_optimization": {"mics_shard_size": 2}}, {"expert_parallel": {"enabled": True}}):
        assert cpu_trainer(hpz_partition_size=1, config=config).strategy.hpz_partition_size == 1


@pytest.mark.parametrize(("version", "bf16", "refused"), [("0.19.5", True, True), ("0.19.6", True, False)])
def test_qwz_on_bf16_is_refused_where_deepspeed_reads_it_as_fp16(version, bf16, refused):
    if not refused:
        validate_qwz_precision(True, bf16, version)
        return
    with pytest.raises(HpzConfigurationError, match=r'7775.*pip install "deepspeed>=0.19.6"'):
        validate_qwz_precision(True, bf16, version)


def test_qwz_on_fp16_or_without_qwz_is_accepted_on_old_releases():
    validate_qwz_precision(True, False, "0.16.9")
    validate_qwz_precision(False, True, "0.16.9")


def test_the_strategy_refuses_qwz_on_bf16_as_it_is_built():
    strategy = HpzStrategy(quantized_weights=True, hpz_partition_size=8, config={"bf16": {"enabled": True}})
    strategy.parallel_devices = [torch.device("cuda", index) for index in range(8)]
    strategy.num_nodes = 2
    with mock.patch("importlib.metadata.version", return_value="0.18.9"), pytest.raises(HpzConfigurationError):
        strategy._resolve_layout()


def test_fabric_accumulation_names_the_release_where_deepspeed_lacks_it(monkeypatch):
    # LitGPT's loops accumulate under `fabric.no_backward_sync`; DeepSpeed lets the loop own that boundary from 0.19.4
    from lightning_hpz.partitioning import loop_owned_accumulation
    from lightning_hpz.strategy.accumulate_until_step import ACCUMULATE_UNTIL_STEP

    monkeypatch.setattr(loop_owned_accumulation, "loop_owned_accumulation_available", lambda: False)
    with pytest.raises(ValueError, match=r'from 0.19.4 on.*pip install "deepspeed>=0.19.5"'):
        ACCUMULATE_UNTIL_STEP.no_backward_sync(object(), enabled=True)
    assert ACCUMULATE_UNTIL_STEP.no_backward_sync(object(), enabled=False) is not None
