"""When each optimizer step ended, noted without stalling the GPU and read in one go when a rate is logged.

On a GPU the end of a step is a CUDA event recorded on the current stream (recording does not wait for anything);
reading the times synchronizes once, on the last event. Elsewhere the host clock is exact, since the host waits for
every operation anyway.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class StepClock:
    """``start()`` once, ``mark()`` at the end of every step, ``read()`` for the seconds from the start to each mark."""

    def __init__(self, device: torch.device) -> None:
        self.on_cuda = device.type == "cuda"
        self._origin: Any = None
        self._marks: list[Any] = []

    def start(self) -> None:
        self._origin = self._now()
        self._marks = []

    def mark(self) -> None:
        self._marks.append(self._now())

    def read(self) -> list[float]:
        """Seconds from :meth:`start` to each mark since the last read (one host sync on a GPU), oldest first."""
        marks, self._marks = self._marks, []
        if not self.on_cuda:
            return [mark - self._origin for mark in marks]
        if marks:
            marks[-1].synchronize()  # events on one stream complete in order: the last covers the others
        return [self._origin.elapsed_time(mark) / 1000.0 for mark in marks]

    def _now(self) -> Any:
        if not self.on_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
