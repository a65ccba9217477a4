"""The ordering of secondary-partition copies, tested without CUDA.

The emulated device stands in for an asynchronous accelerator; a counting fake stands in for DeepSpeed's CUDA
accelerator to show which mode synchronizes the host and which does not, through DeepSpeed's real
``Init._partition_param_sec``.
"""

import math
from types import SimpleNamespace

import pytest
import torch
from deepspeed.runtime.zero import partition_parameters
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from lightning_hpz.partitioning import deepspeed_patch
from lightning_hpz.partitioning.emulation import EmulatedAsyncDevice, EmulatedEvent, EmulatedStream
from lightning_hpz.partitioning.ordering import CopyOrdering


def _copied_shard(device: EmulatedAsyncDevice, values) -> torch.Tensor:
    shard = torch.tensor(values, dtype=torch.float32)
    device.defer_copy(shard)
    return shard


def test_deferred_copy_is_poisoned_until_ordered():
    device = EmulatedAsyncDevice()
    shard = _copied_shard(device, [1.0, 2.0])
    assert torch.isnan(shard).all()
    device.current_stream().synchronize()
    assert shard.tolist() == [1.0, 2.0]


def test_event_wait_lands_exactly_the_copies_before_the_event():
    stream = EmulatedStream()
    first, second = torch.zeros(1), torch.zeros(1)
    stream.enqueue_copy(first, torch.ones(1))
    event = EmulatedEvent()
    event.record(stream)
    stream.enqueue_copy(second, torch.ones(1))
    EmulatedStream().wait_event(event)  # another stream waits
    assert first.item() == 1.0 and second.item() == 0.0
    assert stream.pending == 1


@pytest.mark.parametrize(("mode", "ready_before_gather"), [("event", True), ("stream", True), ("none", False)])
def test_modes_order_the_copy_before_the_gather(mode, ready_before_gather):
    device = EmulatedAsyncDevice()
    ordering = CopyOrdering(mode, device)
    shard = _copied_shard(device, [3.0, 4.0])
    ordering.after_secondary_copy(shard)
    ordering.before_secondary_gather([shard])
    assert (not torch.isnan(shard).any()) == ready_before_gather


def test_event_mode_never_synchronizes_the_host():
    device = EmulatedAsyncDevice()
    ordering = CopyOrdering("event", device)
    shards = [_copied_shard(device, [float(i)]) for i in range(5)]
    for shard in shards:
        ordering.after_secondary_copy(shard)
    assert ordering.host_syncs == 0 and ordering.events_recorded == 5
    assert device.stream.pending == 5  # nothing landed merely because an event was recorded
    ordering.before_secondary_gather(shards)
    # events of one stream complete in order: one wait on the latest covers all five copies
    assert ordering.events_waited == 1
    assert [s.item() for s in shards] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_stream_mode_synchronizes_once_per_copy():
    device = EmulatedAsyncDevice()
    ordering = CopyOrdering("stream", device)
    for i in range(3):
        ordering.after_secondary_copy(_copied_shard(device, [float(i)]))
    assert ordering.host_syncs == 3 and ordering.events_recorded == 0


def test_synchronous_device_needs_no_ordering():
    cpu_like = SimpleNamespace(resolves_data_dependency=lambda: True)
    for mode in ("event", "stream"):
        ordering = CopyOrdering(mode, cpu_like)
        shard = torch.ones(2)
        ordering.after_secondary_copy(shard)
        ordering.before_secondary_gather([shard])
        assert (ordering.events_recorded, ordering.events_waited, ordering.host_syncs) == (0, 0, 0)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="hpz_sync='later'"):
        CopyOrdering("later", EmulatedAsyncDevice())


def test_poison_for_integer_shards():
    device = EmulatedAsyncDevice()
    shard = torch.tensor([1, 2], dtype=torch.int8)
    device.defer_copy(shard)
    assert shard.tolist() == [127, 127]


# ------------------------------------------------------------------------- through DeepSpeed's real function
class CountingStream:
    def __init__(self) -> None:
        self.synchronized = 0
        self.waited = []

    def synchronize(self) -> None:
        self.synchronized += 1

    def wait_event(self, event) -> None:
        self.waited.append(event)


class FakeAsyncAccelerator:
    """Looks like DeepSpeed's CUDA accelerator to partition_parameters: copies do not resolve by themselves."""

    def __init__(self) -> None:
        self.stream = CountingStream()
        self.events = []

    def resolves_data_dependency(self) -> bool:
        return False

    def current_stream(self) -> CountingStream:
        return self.stream

    def Event(self):
        event = SimpleNamespace(recorded_on=None)
        event.record = lambda stream: setattr(event, "recorded_on", stream)
        self.events.append(event)
        return event

    def pin_memory(self, tensor):
        return tensor


def _partition_owner(world: int = 4, group: int = 2, rank_in_group: int = 1):
    return SimpleNamespace(
        _aligned_size=lambda p: math.ceil(p.numel() / world) * world,
        dp_world_size=world,
        num_ranks_in_param_group=group,
        rank_in_group=rank_in_group,
        remote_device="cpu",
        pin_memory=False,
        quantized_nontrainable_weights=False,
    )


def _available_param(numel: int = 10) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.arange(float(numel)))
    param.ds_status = ZeroParamStatus.AVAILABLE
    param.ds_secondary_tensor = None
    param.ds_numel = numel
    param.ds_id = 0
    return param


@pytest.fixture
def fake_accelerator(monkeypatch):
    accelerator = FakeAsyncAccelerator()
    monkeypatch.setattr(partition_parameters, "get_accelerator", lambda: accelerator)
    monkeypatch.setattr(partition_parameters, "print_rank_0", lambda *args, **kwargs: None)  # needs a process group
    yield accelerator
    deepspeed_patch.uninstall()


@pytest.mark.parametrize(("mode", "host_syncs", "events"), [("event", 0, 1), ("stream", 1, 0), ("none", 0, 0)])
def test_each_mode_replaces_deepspeeds_own_synchronize(fake_accelerator, mode, host_syncs, events):
    deepspeed_patch.install(mode)
    param = _available_param()
    partition_parameters.Init._partition_param_sec(_partition_owner(), param)
    # DeepSpeed >= 0.13.5 would synchronize once here by itself; each mode does exactly what it says instead
    assert fake_accelerator.stream.synchronized == host_syncs
    assert len(fake_accelerator.events) == events
    # rank 1 of a pair holds the second half of the (padded to 12) flat parameter: elements 6..9, then zero padding
    assert param.ds_secondary_tensor.tolist() == [6.0, 7.0, 8.0, 9.0, 0.0, 0.0]


def test_unchanged_secondary_records_nothing(fake_accelerator):
    ordering = deepspeed_patch.install("event")
    param = _available_param()
    owner = _partition_owner()
    partition_parameters.Init._partition_param_sec(owner, param)
    partition_parameters.Init._partition_param_sec(owner, param)  # already partitioned: DeepSpeed returns early
    assert ordering.events_recorded == 1


def test_without_an_active_ordering_deepspeed_behaves_as_shipped(fake_accelerator):
    deepspeed_patch.install("event")
    deepspeed_patch.uninstall()  # as at a strategy's teardown
    assert partition_parameters.Init._partition_param_sec is deepspeed_patch._ORIGINAL_PARTITION_PARAM_SEC
    partition_parameters.Init._partition_param_sec(_partition_owner(), _available_param())
    assert fake_accelerator.stream.synchronized == 1  # DeepSpeed's own PR #5216 synchronize


def test_gather_waits_on_the_copy_event(fake_accelerator):
    ordering = deepspeed_patch.install("event")
    param = _available_param()
    partition_parameters.Init._partition_param_sec(_partition_owner(), param)
    ordering.before_secondary_gather([param.ds_secondary_tensor])
    assert fake_accelerator.stream.waited == fake_accelerator.events
