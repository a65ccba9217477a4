"""How the copy that fills a secondary partition is ordered before the all-gather that reads it.

ZeRO-3 with hpZ writes each secondary shard with an asynchronous copy on the compute stream, and prefetch later
reads it from a separate all-gather stream. The three modes differ only in what joins those two streams:

* ``"event"``  records an event after the copy; the gathering stream waits on it (no host stall).
* ``"stream"`` blocks the host until the compute stream has drained (DeepSpeed PR #5216, the paper's fix).
* ``"none"``   orders nothing: the pre-fix race, kept only to reproduce it.

The logic is written against a small device protocol (``resolves_data_dependency``, ``current_stream``, ``Event``)
that both DeepSpeed's accelerator objects and :class:`~lightning_hpz.partitioning.emulation.EmulatedAsyncDevice`
satisfy, so it is tested without CUDA.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import torch

SYNC_MODES = ("event", "stream", "none")

# The event that marks the end of a secondary shard's copy travels with the tensor it describes, so it is dropped
# together with the shard whenever DeepSpeed frees or replaces it.
_READY_EVENT_ATTR = "_hpz_copy_done"


class CopyOrdering:
    """Orders secondary-partition copies before the all-gathers that read them, in one of :data:`SYNC_MODES`.

    Args:
        mode: ``"event"``, ``"stream"`` or ``"none"``.
        device: the accelerator the copies run on (DeepSpeed's ``get_accelerator()`` or an emulated one).
    """

    def __init__(self, mode: str, device: Any) -> None:
        if mode not in SYNC_MODES:
            raise ValueError(f"hpz_sync={mode!r} is not a mode; choose one of {SYNC_MODES}.")
        self.mode = mode
        self.device = device
        self._sequence = itertools.count()
        self.events_recorded = 0
        self.events_waited = 0
        self.host_syncs = 0

    @property
    def is_active(self) -> bool:
        # A synchronous device (DeepSpeed's CPU accelerator) finishes every copy before returning: nothing to order.
        return not self.device.resolves_data_dependency()

    def after_secondary_copy(self, secondary: torch.Tensor) -> None:
        """Called right after the copy into ``secondary`` was issued on the current stream."""
        if not self.is_active:
            return
        if self.mode == "event":
            stream = self.device.current_stream()
            event = self.device.Event()
            event.record(stream)
            setattr(secondary, _READY_EVENT_ATTR, (next(self._sequence), stream, event))
            self.events_recorded += 1
        elif self.mode == "stream":
            self.device.current_stream().synchronize()
            self.host_syncs += 1

    def before_secondary_gather(self, secondaries: Iterable[torch.Tensor]) -> None:
        """Called on the gathering stream before an all-gather reads ``secondaries``."""
        if self.mode != "event" or not self.is_active:
            return
        gathering_stream = self.device.current_stream()
        for event in _latest_event_per_stream(secondaries):
            gathering_stream.wait_event(event)
            self.events_waited += 1


def _latest_event_per_stream(secondaries: Iterable[torch.Tensor]) -> list[Any]:
    """One event per recording stream: events on one stream complete in order, so the latest covers the rest."""
    latest: dict[Any, tuple[int, Any]] = {}
    for secondary in secondaries:
        marker = getattr(secondary, _READY_EVENT_ATTR, None)
        if marker is None:
            continue
        sequence, stream, event = marker
        # Stream objects hash and compare by the device stream they wrap (torch.cuda.Stream does).
        if stream not in latest or sequence > latest[stream][0]:
            latest[stream] = (sequence, event)
    return [event for _, event in latest.values()]
