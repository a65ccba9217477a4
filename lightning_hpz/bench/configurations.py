"""The training configurations a benchmark compares, by name, and what each one is equivalent to for the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

# A small model under ZeRO-3 would otherwise keep every gathered parameter alive from forward to backward (DeepSpeed's
# defaults are 1e9 elements), so backward would gather nothing and hpZ would have nothing to save. With these
# thresholds each module is released after its forward and re-gathered in backward, as in a multi-billion model.
REGATHER_THRESHOLDS: dict[str, Any] = {
    "stage3_max_live_parameters": 0,
    "stage3_max_reuse_distance": 0,
    "stage3_param_persistence_threshold": 0,
    "stage3_prefetch_bucket_size": 0,
}
REGATHER_NOTE = (
    "ZeRO-3 thresholds scaled to the model (stage3_max_live_parameters=0, stage3_max_reuse_distance=0, "
    "stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0): every module is released after forward "
    "and re-gathered in backward, as in a 7B model. DeepSpeed's defaults (1e9) would keep this small model gathered "
    "through backward, and hpZ would then save nothing."
)


@dataclass(frozen=True)
class BenchConfiguration:
    """One way of training the workload.

    ``driver`` is who runs the loop: ``"lightning"`` (a Trainer with :class:`~lightning_hpz.HpzStrategy`),
    ``"deepspeed"`` (a DeepSpeed engine driven by hand), ``"fsdp2"`` or ``"ddp"`` (PyTorch, by hand).
    ``zero_stage``/``hpz`` describe the communication pattern for the model; for the PyTorch peers they name the ZeRO
    setup with the same traffic (FSDP2 full shard = ZeRO-3, FSDP2 resharding to a node = hpZ, DDP = stage 0's
    all-reduce, ZeRO stage 0 in the model).
    """

    name: str
    driver: str
    zero_stage: int
    hpz: bool = False
    hpz_sync: str = "event"
    description: str = ""

    def hpz_partition_size(self, devices_per_node: int) -> int:
        return devices_per_node if self.hpz else 1

    def strategy_kwargs(self, devices_per_node: int) -> dict[str, Any]:
        """HpzStrategy arguments (``lightning`` driver) or the ZeRO section to build (``deepspeed`` driver)."""
        kwargs: dict[str, Any] = {"stage": self.zero_stage}
        if self.zero_stage == 3:
            kwargs["hpz_partition_size"] = self.hpz_partition_size(devices_per_node)
            kwargs["config"] = {"zero_optimization": dict(REGATHER_THRESHOLDS)}
        if self.driver == "lightning":
            kwargs["hpz_sync"] = self.hpz_sync
        return kwargs


CONFIGURATIONS: dict[str, BenchConfiguration] = {
    c.name: c
    for c in (
        BenchConfiguration("zero3", "lightning", 3, description="HpzStrategy, plain ZeRO-3 (hpz_partition_size=1)"),
        BenchConfiguration("hpz-event", "lightning", 3, hpz=True, description="HpzStrategy, hpZ, hpz_sync='event'"),
        BenchConfiguration(
            "hpz-stream", "lightning", 3, hpz=True, hpz_sync="stream", description="HpzStrategy, hpZ, 'stream'"
        ),
        BenchConfiguration(
            "hpz-none", "lightning", 3, hpz=True, hpz_sync="none", description="HpzStrategy, hpZ, 'none' (unordered)"
        ),
        BenchConfiguration("zero1", "lightning", 1, description="HpzStrategy, ZeRO-1"),
        BenchConfiguration("zero2", "lightning", 2, description="HpzStrategy, ZeRO-2"),
        BenchConfiguration(
            "deepspeed-hpz", "deepspeed", 3, hpz=True, description="raw DeepSpeed engine, the hpz-event config"
        ),
        BenchConfiguration("fsdp2-full", "fsdp2", 3, description="FSDP2 fully_shard, reshard_after_forward=True"),
        BenchConfiguration(
            "fsdp2-node", "fsdp2", 3, hpz=True, description="FSDP2 reshard_after_forward=<devices per node>"
        ),
        BenchConfiguration("ddp", "ddp", 0, description="PyTorch DistributedDataParallel"),
    )
}
QUICK_CONFIGURATIONS = ("zero3", "hpz-event", "fsdp2-node")


def select(names: Optional[list[str]], quick: bool) -> list[BenchConfiguration]:
    """The configurations to run, in the given order; the quick or full default set when ``names`` is empty."""
    names = list(names or (QUICK_CONFIGURATIONS if quick else CONFIGURATIONS))
    unknown = [n for n in names if n not in CONFIGURATIONS]
    if unknown:
        raise ValueError(f"unknown configuration(s) {unknown}; choose from {sorted(CONFIGURATIONS)}.")
    if len(set(names)) != len(names):
        raise ValueError(f"configuration listed twice in {names}; give each once.")
    return [CONFIGURATIONS[n] for n in names]
