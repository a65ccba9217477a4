"""What one rank of a study cell measures: peak memory above a baseline, step times, tokens, FLOPs and losses.

Memory: on a GPU, ``torch.cuda.max_memory_allocated`` after resetting the peak at the baseline; on a CPU, the
process's resident set: the kernel's high-water mark (``VmHWM``) reset at the baseline through
``/proc/self/clear_refs`` where Linux allows it, else ``ru_maxrss`` (a peak since the process started). The baseline is
taken once the data is ready and before the model is built, so ``peak - baseline`` is what training added: model
states, activations and the engine's buffers, without the Python/torch/DeepSpeed runtime (hundreds of MB on CPU).

``settled`` is what stays allocated after the last step (the planner's "between steps"): ``memory_allocated`` on a GPU;
on a CPU the resident set after ``malloc_trim(0)`` has handed freed heap memory back to the kernel (glibc keeps it
otherwise, and the resident set would still show the step's transients).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from lightning_hpz.callbacks.batch_tokens import _detect_batch_tokens
from lightning_hpz.callbacks.model_flops import shape_from_config, training_flops
from lightning_hpz.process_memory import max_rss_bytes

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_bytes(field: str) -> Optional[int]:
    if not _STATUS.exists():
        return None
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # reported in kB
    return None


def _release_free_heap() -> None:
    """glibc only: return freed heap pages to the kernel, so the resident set shows live memory."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _reset_high_water_mark() -> bool:
    """Linux >= 4.0: writing 5 to clear_refs resets VmHWM to the current RSS."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return _status_bytes("VmHWM") is not None


class MemoryProbe:
    """:meth:`start` at the baseline, :meth:`result` at the end (method, baseline, peak and settled bytes)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.method = ""
        self.baseline = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.method, self.baseline = "cuda_max_allocated", torch.cuda.memory_allocated(self.device)
            return
        _release_free_heap()  # the baseline and the settled value are both taken after a trim
        if _reset_high_water_mark():
            self.method, self.baseline = "rss_high_water_mark", _status_bytes("VmRSS") or 0
        else:  # the peak may then predate the baseline; the increment is then a lower bound
            self.method, self.baseline = "ru_maxrss", max_rss_bytes()

    def peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        if self.method == "rss_high_water_mark":
            return _status_bytes("VmHWM") or 0
        return max_rss_bytes()

    def settled(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        _release_free_heap()
        return _status_bytes("VmRSS") or 0

    def result(self) -> dict[str, Any]:
        """Call once training is over and before anything is freed."""
        peak = self.peak()  # before the trim, which cannot lower a high-water mark but could the current RSS
        return {
            "method": self.method,
            "baseline_bytes": self.baseline,
            "peak_bytes": peak,
            "settled_bytes": self.settled(),
        }


class CellMeasurement(Callback):
    """Per step: end time, loss, tokens and FLOPs of this rank's batch; memory from the baseline to the end."""

    def __init__(self) -> None:
        self.memory: Optional[MemoryProbe] = None
        self.step_ends: list[float] = []
        self.losses: list[float] = []
        self.tokens: list[int] = []
        self.flops: list[float] = []
        self.shape: Any = None
        self.memory_result: Optional[dict[str, Any]] = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Lightning calls this after the datamodule's setup and before configure_model builds the model.
        self.memory = MemoryProbe(trainer.strategy.root_device)
        self.memory.start()
        self.shape = shape_from_config(pl_module.hf_config)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, *args: Any
    ) -> None:
        loss = float(outputs["loss"])  # a host sync: the step's work is done when the time is taken
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        self.step_ends.append(time.perf_counter())
        self.losses.append(loss)
        counts = _detect_batch_tokens(batch)
        self.tokens.append(counts.real_tokens)
        self.flops.append(training_flops(self.shape, counts.samples, counts.input_positions, counts.target_positions))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The model, gradients and optimizer states still exist here: the planner's "between steps".
        self.memory_result = self.memory.result() if self.memory is not None else None

    def record(self, warmup: int) -> dict[str, Any]:
        """The rank's measurements; step times and tokens cover the steps after ``warmup``."""
        ends = self.step_ends
        return {
            "losses": self.losses,
            "step_times": [later - earlier for earlier, later in itertools.pairwise(ends[warmup - 1 :])],
            "measured_tokens": sum(self.tokens[warmup:]),
            "measured_flops": sum(self.flops[warmup:]),
            "memory": self.memory_result,
        }
