"""Peak FLOP/s per device: a table for common data-center GPUs by dtype, and a measurement for CPUs.

Dense tensor-core peaks (without 2:4 sparsity) from NVIDIA's datasheets: A100 Tensor Core GPU datasheet (2021, SXM4
and PCIe give the same tensor peaks); H100 Tensor Core GPU datasheet (2023, SXM5 and PCIe columns, the "with
sparsity" figures halved); H200 Tensor Core GPU datasheet/product brief (2024, SXM and NVL columns, halved likewise).
"""

from __future__ import annotations

import time
from typing import Optional

import torch

_TFLOPS: dict[str, dict[str, float]] = {
    "a100": {"float32": 19.5, "tf32": 156.0, "bfloat16": 312.0, "float16": 312.0, "int8": 624.0},
    "h100 sxm": {"float32": 67.0, "tf32": 494.7, "bfloat16": 989.4, "float16": 989.4, "float8": 1978.9},
    "h100 pcie": {"float32": 51.0, "tf32": 378.0, "bfloat16": 756.0, "float16": 756.0, "float8": 1513.0},
    "h200 sxm": {"float32": 67.0, "tf32": 494.7, "bfloat16": 989.4, "float16": 989.4, "float8": 1978.9},
    "h200 nvl": {"float32": 60.0, "tf32": 417.5, "bfloat16": 835.5, "float16": 835.5, "float8": 1670.5},
}
PEAK_FLOPS: dict[str, dict[str, float]] = {chip: {k: v * 1e12 for k, v in row.items()} for chip, row in _TFLOPS.items()}


def chip_key(device_name: str) -> Optional[str]:
    """The table's key for a CUDA device name such as ``"NVIDIA H100 80GB HBM3"``, or None if it is not listed."""
    name = device_name.lower()
    if "a100" in name:
        return "a100"
    for chip in ("h200", "h100"):
        if chip in name:
            return f"{chip} {'pcie' if 'pcie' in name else 'nvl' if 'nvl' in name else 'sxm'}"
    return None


def dtype_key(dtype: torch.dtype) -> str:
    """``float32`` matmuls run as TF32 unless ``torch.set_float32_matmul_precision("highest")``."""
    if dtype == torch.float32:
        return "float32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    return {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.int8: "int8"}.get(dtype, str(dtype))


def table_peak_flops(device_name: str, dtype: torch.dtype) -> Optional[float]:
    chip = chip_key(device_name)
    return None if chip is None else PEAK_FLOPS[chip].get(dtype_key(dtype))


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
    """Peak FLOP/s of ``device`` for ``dtype``: the table for a listed GPU, a measurement for a CPU, else None."""
    if device.type == "cuda":
        return table_peak_flops(torch.cuda.get_device_name(device), dtype)
    if device.type == "cpu" and measure_cpu:
        return measure_matmul_flops(dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32)
    return None
