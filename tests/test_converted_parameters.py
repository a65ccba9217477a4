"""Parameters a ``deepspeed.zero.Init`` converted before the strategy existed get ordered gathers at setup, or keep
DeepSpeed's own copy synchronize when they have no gather to wrap."""

import sys

import pytest
import torch
from conftest import assert_succeeded, run_script
from deepspeed.runtime.zero import partition_parameters
from test_copy_ordering import _available_param, _partition_owner, fake_accelerator  # noqa: F401 - fixture
from torch import nn

from lightning_hpz.partitioning import deepspeed_patch, order_converted_parameters


def _module_of(*params: nn.Parameter) -> nn.Module:
    module = nn.Module()
    for index, param in enumerate(params):
        module.register_parameter(f"p{index}", param)
    return module


@pytest.fixture
def emulated_event_ordering():
    ordering = deepspeed_patch.install("event", emulate_async_copy=True)
    yield ordering
    deepspeed_patch.uninstall()


def test_plain_gather_is_wrapped_and_then_reads_the_landed_copy(emulated_event_ordering):
    ordering = emulated_event_ordering
    param = nn.Parameter(torch.zeros(4))
    param.ds_id = 7
    param.ds_secondary_tensor = torch.tensor([1.0, 2.0])
    ordering.device.defer_copy(param.ds_secondary_tensor)  # the copy is issued, not landed
    ordering.after_secondary_copy(param.ds_secondary_tensor)
    read = []
    param.all_gather_coalesced = lambda params, **kwargs: read.append(params[0].ds_secondary_tensor.tolist())
    param.all_gather_coalesced([param])  # DeepSpeed's unordered gather: overtakes the copy
    converted = order_converted_parameters(_module_of(param, nn.Parameter(torch.ones(2))))
    param.all_gather_coalesced([param])
    assert torch.isnan(torch.tensor(read[0])).all() and read[1] == [1.0, 2.0]
    assert (converted.wrapped, converted.stock_sync) == (1, 0)  # the plain tensor is no ZeRO-3 parameter
    assert order_converted_parameters(_module_of(param)).wrapped == 0  # wrapped once only


def test_parameter_without_a_gather_keeps_deepspeeds_synchronize(fake_accelerator):  # noqa: F811
    deepspeed_patch.install("event")
    unwrappable, ordinary = _available_param(), _available_param()
    ordinary.all_gather_coalesced = lambda params, **kwargs: None
    converted = order_converted_parameters(_module_of(unwrappable, ordinary))
    assert (converted.wrapped, converted.stock_sync) == (1, 1)
    partition_parameters.Init._partition_param_sec(_partition_owner(), unwrappable)
    assert (fake_accelerator.stream.synchronized, len(fake_accelerator.events)) == (1, 0)  # DeepSpeed's own
    partition_parameters.Init._partition_param_sec(_partition_owner(), ordinary)
    assert (fake_accelerator.stream.synchronized, len(fake_accelerator.events)) == (1, 1)  # ordered by the event


@pytest.mark.multiprocess
def test_model_built_under_zero_init_before_import_trains_exactly_ordered(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    run = run_script(
        "converted_before_setup.py",
        {"mode": "event"},
        tmp_path / "out",
        timeout=300,
        launcher=torchrun,
        env={"DS_ACCELERATOR": "cpu"},
    )
    assert_succeeded(run, ranks=2)
    for record in run.ranks.values():
        assert record["ordered_gathers"] == record["parameters"] == 6
        assert record["losses_finite"] and record["steps"] == 6
        assert record["checks"] == 3 and record["secondaries"] == 6  # integrity checked at steps 0, 2, 4
        assert record["events_waited"] > 0
