"""What each rank of a benchmark run records: per-step loss and end time, and the link counters around the window.

The measured window is the steps after the warm-up. At both ends of it every rank meets in a barrier, the first
process of each node reads its veth end's transmit counter, and everyone meets again, so that no byte of a measured
step is counted outside the window and no byte of the warm-up or of the next step inside it.
"""

from __future__ import annotations

import itertools
import json
import os
import resource
import time
from pathlib import Path
from typing import Any, Optional

from lightning_hpz import collectives

INTERFACE_ENV_VAR = "GLOO_SOCKET_IFNAME"


def read_tx_bytes(interface: Optional[str]) -> Optional[int]:
    """Bytes sent so far by ``interface`` of this process's network namespace, or ``None`` without one."""
    if not interface:
        return None
    path = Path(f"/sys/class/net/{interface}/statistics/tx_bytes")
    return int(path.read_text()) if path.exists() else None


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux reports ``ru_maxrss`` in KiB): libraries, model states,
    activations and communication buffers together."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class StepRecorder:
    """Call :meth:`step_done` after every optimizer step (same count on every rank); :meth:`write` at the end."""

    def __init__(self, steps: int, warmup: int) -> None:
        if not 0 < warmup < steps:
            raise ValueError(f"warmup={warmup} must lie between 1 and steps-1={steps - 1}.")
        self.steps = steps
        self.warmup = warmup
        self.rank = collectives.rank()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.interface = os.environ.get(INTERFACE_ENV_VAR)
        self.losses: list[float] = []
        self.step_ends: list[float] = []
        self.marks: dict[str, dict[str, Any]] = {}

    def step_done(self, loss: float) -> None:
        self.step_ends.append(time.perf_counter())
        self.losses.append(float(loss))
        done = len(self.losses)
        if done == self.warmup:
            self._mark("start")
        elif done == self.steps:
            self._mark("end")

    def _mark(self, name: str) -> None:
        collectives.barrier()
        tx = read_tx_bytes(self.interface) if self.local_rank == 0 else None
        collectives.barrier()
        self.marks[name] = {"time": time.perf_counter(), "tx_bytes": tx}

    def step_times(self) -> list[float]:
        """Seconds of each measured step (the first one counted from the end of the start barrier)."""
        if "start" not in self.marks or len(self.step_ends) < self.steps:
            return []
        ends = [self.marks["start"]["time"], *self.step_ends[self.warmup :]]
        return [later - earlier for earlier, later in itertools.pairwise(ends)]

    def record(self, **extra: Any) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": collectives.world_size(),
            "interface": self.interface,
            "losses": self.losses,
            "step_times": self.step_times(),
            "tx_bytes_start": self.marks.get("start", {}).get("tx_bytes"),
            "tx_bytes_end": self.marks.get("end", {}).get("tx_bytes"),
            "peak_rss_bytes": peak_rss_bytes(),
            **extra,
        }

    def write(self, out: Path, **extra: Any) -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{self.rank}.json").write_text(json.dumps(self.record(**extra)))
