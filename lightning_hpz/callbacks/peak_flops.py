"""Peak FLOP/s per device: Lightning's table first, a few chips it lacks here, and a measurement for CPUs.

Lightning's ``get_available_flops`` knows most NVIDIA GPUs. Kept here only what it does not answer right
(lightning 2.6): the H200 under the names the driver really reports (Lightning matches "h200 sxm1"/"h200 nvl1" only),
the L40S (Lightning's "l4" substring test reads it as an L4, a third of its peak) and AMD's MI300X (ROCm reports it
as a "cuda" device). Dense peaks (without 2:4 sparsity) from the vendors' datasheets: NVIDIA H200 Tensor Core GPU
product brief (2024, SXM and NVL columns, the "with sparsity" figures halved), NVIDIA L40S datasheet (2023, halved
likewise), AMD Instinct MI300X data sheet (2023). An unknown chip is reported once and gets no MFU; never an error.
"""

from __future__ import annotations

import time
import warnings
from typing import Optional

import torch
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

_TFLOPS: dict[str, dict[str, float]] = {
    "h200 sxm": {"float32": 67.0, "tf32": 494.7, "bfloat16": 989.4, "float16": 989.4, "float8": 1978.9},
    "h200 nvl": {"float32": 60.0, "tf32": 417.5, "bfloat16": 835.5, "float16": 835.5, "float8": 1670.5},
    "l40s": {"float32": 91.6, "tf32": 183.0, "bfloat16": 362.05, "float16": 362.05, "float8": 733.0, "int8": 733.0},
    "mi300x": {"float32": 163.4, "tf32": 653.7, "bfloat16": 1307.4, "float16": 1307.4, "float8": 2614.9},
}
PEAK_FLOPS: dict[str, dict[str, float]] = {chip: {k: v * 1e12 for k, v in row.items()} for chip, row in _TFLOPS.items()}
# Chips Lightning matches to another chip's figures: the table above must answer before Lightning is asked.
_MISREAD_BY_LIGHTNING = ("l40s",)
_reported_unknown: set[str] = set()


def chip_key(device_name: str) -> Optional[str]:
    """This table's key for a device name such as ``"NVIDIA H200 NVL"``, or None if it is not listed here."""
    name = device_name.lower()
    if "h200" in name:
        return "h200 nvl" if "nvl" in name else "h200 sxm"
    return next((chip for chip in ("l40s", "mi300x") if chip in name), None)


def dtype_key(dtype: torch.dtype) -> str:
    """``float32`` matmuls run as TF32 unless ``torch.set_float32_matmul_precision("highest")``."""
    if dtype == torch.float32:
        return "float32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    return {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.int8: "int8"}.get(dtype, str(dtype))


def table_peak_flops(device_name: str, dtype: torch.dtype) -> Optional[float]:
    chip = chip_key(device_name)
    return None if chip is None else PEAK_FLOPS[chip].get(dtype_key(dtype))


def lightning_peak_flops(device: torch.device, dtype: torch.dtype) -> Optional[float]:
    """Lightning's answer, without its warning for chips it lacks (this module reports those itself, once)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flops = get_available_flops(device, dtype)
    return None if flops is None else float(flops)


def gpu_peak_flops(device: torch.device, dtype: torch.dtype) -> Optional[float]:
    """Peak FLOP/s of the GPU ``device`` for ``dtype``, or None (reported once per chip) when nobody knows it."""
    name = torch.cuda.get_device_name(device)
    if chip_key(name) in _MISREAD_BY_LIGHTNING:
        return table_peak_flops(name, dtype)
    flops = lightning_peak_flops(device, dtype)
    if flops is None:
        flops = table_peak_flops(name, dtype)
    if flops is None and name not in _reported_unknown:
        _reported_unknown.add(name)
        rank_zero_warn(
            f"No peak FLOP/s known for {name!r} at {dtype}: no MFU is reported. Pass "
            "`TokenThroughputMonitor(peak_flops=...)` with the datasheet's dense figure to get it."
        )
    return flops


def measure_matmul_flops(dtype: torch.dtype = torch.float32, size: int = 512, repeats: int = 5) -> float:
    """FLOP/s of the fastest of ``repeats`` square matmuls on this CPU (an achievable peak, not a datasheet one)."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def peak_flops_for(device: torch.device, dtype: torch.dtype, measure_cpu: bool = True) -> Optional[float]:
    """Peak FLOP/s of ``device`` for ``dtype``: datasheet figures for a GPU, a measurement for a CPU, else None."""
    if device.type == "cuda":
        return gpu_peak_flops(device, dtype)
    if device.type == "cpu" and measure_cpu:
        return measure_matmul_flops(dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32)
    return None
