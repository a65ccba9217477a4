"""A CPU stand-in for an accelerator whose copies finish late, to reproduce the hpZ race without a GPU.

A CPU copies synchronously, so the race of arXiv 2407.01614 cannot happen there by itself. Under emulation each
secondary-partition copy is queued on an emulated stream and the shard holds poison (NaN) until something orders
after the copy: an event wait lands the copies up to that event, a stream synchronize lands them all. Whatever
reads the shard before that reads poison, exactly as an all-gather that overtakes the real copy would.
"""

from __future__ import annotations

import os
import weakref

import torch

EMULATION_ENV_VAR = "LIGHTNING_HPZ_EMULATE_ASYNC_COPY"


def emulation_requested() -> bool:
    """Whether the environment asks for the emulation (the variable reaches every launched process)."""
    return os.environ.get(EMULATION_ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


class EmulatedStream:
    """An ordered queue of pending copies; copies land in issue order, only when something waits for them."""

    def __init__(self) -> None:
        self._pending: list[tuple[int, weakref.ref, torch.Tensor]] = []
        self._issued = 0

    def enqueue_copy(self, destination: torch.Tensor, values: torch.Tensor) -> int:
        # A shard that DeepSpeed freed before its copy was ordered can never be read again: forget its copy.
        self._pending = [item for item in self._pending if item[1]() is not None]
        self._issued += 1
        self._pending.append((self._issued, weakref.ref(destination), values))
        return self._issued

    @property
    def issued(self) -> int:
        return self._issued

    @property
    def pending(self) -> int:
        return len(self._pending)

    def land_until(self, position: int) -> None:
        while self._pending and self._pending[0][0] <= position:
            _, destination_ref, values = self._pending.pop(0)
            destination = destination_ref()
            if destination is not None:
                destination.data.copy_(values)

    def synchronize(self) -> None:
        self.land_until(self._issued)

    def wait_event(self, event: EmulatedEvent) -> None:
        event.synchronize()


class EmulatedEvent:
    """Marks a position on an :class:`EmulatedStream`; waiting on it lands every copy issued before it."""

    def __init__(self) -> None:
        self._stream: EmulatedStream | None = None
        self._position = 0

    def record(self, stream: EmulatedStream) -> None:
        self._stream, self._position = stream, stream.issued

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.land_until(self._position)


class EmulatedAsyncDevice:
    """Satisfies the device protocol of :class:`~lightning_hpz.partitioning.ordering.CopyOrdering`."""

    def __init__(self) -> None:
        self.stream = EmulatedStream()

    def resolves_data_dependency(self) -> bool:
        return False

    def current_stream(self) -> EmulatedStream:
        return self.stream

    def Event(self) -> EmulatedEvent:
        return EmulatedEvent()

    def defer_copy(self, destination: torch.Tensor) -> None:
        """Turn a copy that already happened into one that lands later: poison now, the real values when ordered."""
        values = destination.detach().clone()
        destination.data.fill_(poison_value(destination.dtype))
        self.stream.enqueue_copy(destination, values)


def poison_value(dtype: torch.dtype) -> float:
    """NaN where the dtype has one; otherwise the largest value, so integer or quantized shards are wrong too."""
    if dtype.is_floating_point:
        return float("nan")
    return torch.iinfo(dtype).max
