"""One rank of a benchmark configuration whose training loop is written by hand: a raw DeepSpeed engine (ZeRO-3, hpZ or
MiCS), FSDP2 (full shard, reshard to a node, or hybrid sharding), DDP.

The loop is the same for all of them (forward returns the loss, backward, optimizer step); only the wrapping differs.
The DeepSpeed engine gets exactly the config :class:`~lightning_hpz.HpzStrategy` would build for the same
configuration and no copy ordering (lightning_hpz wraps DeepSpeed only while an ``HpzStrategy`` is set up), so its step
time is what the strategy's should match. Process groups are created and destroyed here directly (that is the point
of a hand-written loop); every collective still goes through :mod:`lightning_hpz.collectives`.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_hpz import collectives
from lightning_hpz.bench.configurations import MICS_MISSING, BenchConfiguration
from lightning_hpz.bench.recording import StepRecorder
from lightning_hpz.bench.workload import Workload, build_model, rank_loader, token_set


def mics_section(devices_per_node: int) -> dict[str, Any]:
    """MiCS's keys of the ZeRO section: a replica per node. The hierarchical gather is for groups spanning nodes
    (DeepSpeed asserts 'sharding spans on single node, no need for hierarchy allgather' otherwise)."""
    return {"mics_shard_size": devices_per_node, "mics_hierarchical_params_gather": False}


def strategy_deepspeed_config(configuration: BenchConfiguration, workload: Workload, devices: int) -> dict[str, Any]:
    """The DeepSpeed config a Trainer with ``HpzStrategy(**configuration.strategy_kwargs(devices))`` ends up with."""
    from lightning_hpz import HpzStrategy
    from lightning_hpz.strategy import config as cfg

    kwargs = configuration.strategy_kwargs(devices)
    strategy = HpzStrategy(**{**kwargs, "hpz_sync": "event"})
    config = copy.deepcopy(strategy.config)
    config.setdefault("zero_optimization", {}).update(
        cfg.zero_section(strategy.zero_settings, configuration.hpz_partition_size(devices))
    )
    # What Lightning fills in once it sees the data and the Trainer (no gradient clipping asked for here).
    config.setdefault("train_micro_batch_size_per_gpu", workload.batch_per_rank)
    config.setdefault("gradient_accumulation_steps", 1)
    config.setdefault("gradient_clipping", 0.0)
    return config


def _train(
    step: Callable[[torch.Tensor], torch.Tensor], spec: dict[str, Any], workload: Workload, **extra: Any
) -> None:
    rank, world = collectives.rank(), collectives.world_size()
    recorder = StepRecorder(spec["steps"], spec["warmup"])
    for batch in rank_loader(token_set(workload, spec["steps"], world), workload, rank, world):
        recorder.step_done(step(batch).item())
    recorder.write(Path(spec["out"]), **extra)


def run_deepspeed(spec: dict[str, Any], configuration: BenchConfiguration, workload: Workload) -> None:
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        raise RuntimeError("the benchmark trains on CPU; set DS_ACCELERATOR=cpu for the raw DeepSpeed engine.")
    devices = spec["devices_per_node"]
    config = strategy_deepspeed_config(configuration, workload, devices)
    deepspeed.init_distributed(dist_backend="gloo")
    if configuration.replica_per_node:
        config["zero_optimization"].update(mics_section(devices))
        model = _mics_model(workload, config, devices)
    else:
        model = build_model(workload)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        optimizer=torch.optim.AdamW(model.parameters(), lr=workload.learning_rate),
        config=config,
        dist_init_required=False,
    )

    def step(batch: torch.Tensor) -> torch.Tensor:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
        return loss

    _train(step, spec, workload, deepspeed_config=config)


def _mics_model(workload: Workload, config: dict[str, Any], devices_per_node: int) -> nn.Module:
    """The model built under ``deepspeed.zero.MiCS_Init``, as DeepSpeed requires for MiCS (``zero.Init`` leaves the
    parameters without the MiCS groups and ``MiCS_Optimizer`` refuses them)."""
    import deepspeed

    if not hasattr(deepspeed.zero, "MiCS_Init"):
        raise RuntimeError(f"deepspeed {deepspeed.__version__} has no zero.MiCS_Init: {MICS_MISSING}.")
    # MiCS reads the devices per node from NDEV_PER_NODE, else the accelerator's device count (on the CPU accelerator
    # LOCAL_SIZE or the NUMA nodes), and needs it only for the hierarchical gather; set it to the testbed's anyway.
    os.environ.setdefault("NDEV_PER_NODE", str(devices_per_node))
    with deepspeed.zero.MiCS_Init(config_dict_or_path=config):
        return build_model(workload)


def _sharded_units(model: nn.Module) -> list[nn.Module]:
    # Every parameter lives in a child unit: FSDP2 never reshards the root's own parameters after forward.
    return [model.embed, model.position, *model.blocks, model.head]


def run_fsdp2(spec: dict[str, Any], configuration: BenchConfiguration, workload: Workload) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    devices = spec["devices_per_node"]
    if configuration.replica_per_node:  # HSDP: mesh dim 0 replicates, dim 1 shards (fully_shard's 2-D mesh)
        shape = (dist.get_world_size() // devices, devices)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    reshard: bool | int = devices if configuration.hpz else True
    model = build_model(workload)
    for unit in _sharded_units(model):
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    _train(_plain_step(model, workload), spec, workload, reshard_after_forward=reshard)


def run_ddp(spec: dict[str, Any], configuration: BenchConfiguration, workload: Workload) -> None:
    dist.init_process_group("gloo")
    model = nn.parallel.DistributedDataParallel(build_model(workload))
    _train(_plain_step(model, workload), spec, workload)


def _plain_step(model: nn.Module, workload: Workload) -> Callable[[torch.Tensor], torch.Tensor]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=workload.learning_rate)

    def step(batch: torch.Tensor) -> torch.Tensor:
        loss = model(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step
