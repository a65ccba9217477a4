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
    ``zero_stage``/``hpz``/``replica_per_node`` describe the communication pattern for the model; for the PyTorch
    peers they name the ZeRO setup with the same traffic (FSDP2 full shard = ZeRO-3, FSDP2 resharding to a node = hpZ,
    DDP = stage 0's all-reduce, ZeRO stage 0 in the model). ``replica_per_node``: the model states are sharded over
    the ranks of a node and replicated across nodes (FSDP2 HSDP, DeepSpeed MiCS with ``mics_shard_size`` = devices
    per node), predicted as ``ZeroSetup(3, shard_size=<devices per node>)``.
    """

    name: str
    driver: str
    zero_stage: int
    hpz: bool = False
    hpz_sync: str = "event"
    description: str = ""
    replica_per_node: bool = False

    def hpz_partition_size(self, devices_per_node: int) -> int:
        return devices_per_node if self.hpz else 1

    def shard_size(self, devices_per_node: int) -> Optional[int]:
        """Ranks one copy of the model states is sharded over; ``None``: the whole world."""
        return devices_per_node if self.replica_per_node else None

    def unavailable_reason(self) -> Optional[str]:
        """Why this installation cannot train the configuration, or ``None``. Imports no DeepSpeed; torch only to ask
        gloo for MiCS, where DeepSpeed has it."""
        if self.driver == "deepspeed" and self.replica_per_node:
            if not mics_available():
                return MICS_MISSING
            if not gloo_coalesces():
                return MICS_NEEDS_COALESCING
        return None

    def strategy_kwargs(self, devices_per_node: int) -> dict[str, Any]:
        """HpzStrategy arguments (``lightning`` driver) or the ZeRO section to build (``deepspeed`` driver)."""
        kwargs: dict[str, Any] = {"stage": self.zero_stage}
        if self.zero_stage == 3:
            kwargs["hpz_partition_size"] = self.hpz_partition_size(devices_per_node)
            kwargs["config"] = {"zero_optimization": dict(REGATHER_THRESHOLDS)}
        if self.driver == "lightning":
            kwargs["hpz_sync"] = self.hpz_sync
        return kwargs


MICS_MISSING = (
    "DeepSpeed MiCS needs deepspeed/runtime/zero/mics.py, which this DeepSpeed lacks: DeepSpeed 0.19.8 removed MiCS "
    "and refuses 'mics_shard_size' (https://github.com/deepspeedai/DeepSpeed/issues/8489); 0.18.9 still has it"
)
MICS_NEEDS_COALESCING = (
    "DeepSpeed MiCS gathers parameters inside torch's _coalescing_manager (mics.py "
    "_flat_all_gather_with_coalescing_manager -> deepspeed/comm/torch.py all_gather_coalesced), which torch's gloo "
    "backend, the one this CPU benchmark runs on, does not implement: the first forward fails with 'RuntimeError: "
    "Backend gloo does not implement startCoalescing' (DeepSpeed 0.18.9, torch 2.13); MiCS needs NCCL"
)
HSDP_NOTE = (
    "FSDP2 hybrid sharding (HSDP), as torch documents it: a 2-D DeviceMesh ('replicate', 'shard') = (nodes, devices "
    "per node) from init_device_mesh, fully_shard(unit, mesh=mesh) on the embeddings, each block and the head, then on "
    "the root; reshard_after_forward=True; torch.optim.AdamW; loss.backward(), step, zero_grad. Shards inside a node, "
    "replicates across nodes: gradients reduce-scattered over 'shard', the shard all-reduced over 'replicate'."
)
MICS_NOTE = (
    "DeepSpeed MiCS driven by hand: the deepspeed-hpz engine's ZeRO-3 config (hpZ off) plus mics_shard_size=<devices "
    "per node>, mics_hierarchical_params_gather=false, the model built under deepspeed.zero.MiCS_Init(config), "
    "deepspeed.initialize, engine(batch)/backward/step. The hierarchical gather is off because DeepSpeed asserts that "
    "a shard group spanning one node has no use for it ('sharding spans on single node'). Needs DeepSpeed with "
    "runtime/zero/mics.py (0.9.2-0.18.x; 0.19.8 removed it) and a backend with coalesced collectives (NCCL; gloo "
    "has none, so on this CPU testbed it is refused with the reason)."
)


def mics_available() -> bool:
    """Whether the installed DeepSpeed still has MiCS, found without importing DeepSpeed (finding a submodule would
    import its parent packages)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("deepspeed")
    folders = spec.submodule_search_locations if spec is not None else None
    return any((Path(folder) / "runtime" / "zero" / "mics.py").is_file() for folder in folders or ())


def gloo_coalesces() -> bool:
    """Whether torch's gloo backend implements coalesced collectives (asked of a one-rank group of its own)."""
    import torch.distributed as dist

    return bool(dist.ProcessGroupGloo(dist.HashStore(), 0, 1).supports_coalescing)


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
        BenchConfiguration("fsdp2-hsdp", "fsdp2", 3, description=HSDP_NOTE, replica_per_node=True),
        BenchConfiguration("deepspeed-mics", "deepspeed", 3, description=MICS_NOTE, replica_per_node=True),
        BenchConfiguration("ddp", "ddp", 0, description="PyTorch DistributedDataParallel"),
    )
}
QUICK_CONFIGURATIONS = ("zero3", "hpz-event", "fsdp2-node")


def select(names: Optional[list[str]], quick: bool) -> list[BenchConfiguration]:
    """The configurations to run, in the given order; the quick or full default set when ``names`` is empty.

    The default sets leave out what this installation cannot train (MiCS: without DeepSpeed's MiCS, or over a gloo
    without coalesced collectives); naming such a configuration is refused with the reason.
    """
    if not names:
        defaults = QUICK_CONFIGURATIONS if quick else CONFIGURATIONS
        return [CONFIGURATIONS[n] for n in defaults if CONFIGURATIONS[n].unavailable_reason() is None]
    unknown = [n for n in names if n not in CONFIGURATIONS]
    if unknown:
        raise ValueError(f"unknown configuration(s) {unknown}; choose from {sorted(CONFIGURATIONS)}.")
    if len(set(names)) != len(names):
        raise ValueError(f"configuration listed twice in {names}; give each once.")
    for name in names:
        reason = CONFIGURATIONS[name].unavailable_reason()
        if reason:
            raise ValueError(f"configuration {name!r} cannot run here: {reason}.")
    return [CONFIGURATIONS[n] for n in names]
