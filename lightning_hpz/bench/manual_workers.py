"""One rank of a benchmark configuration whose training loop is written by hand: a raw DeepSpeed engine, FSDP2, DDP.

The loop is the same for all three (forward returns the loss, backward, optimizer step); only the wrapping differs.
The DeepSpeed engine gets exactly the config :class:`~lightning_hpz.HpzStrategy` would build for the same
configuration and no copy ordering (lightning_hpz wraps DeepSpeed only while an ``HpzStrategy`` is set up), so its step
time is what the strategy's should match. Process groups are created and destroyed here directly (that is the point
of a hand-written loop); every collective still goes through :mod:`lightning_hpz.collectives`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_hpz import collectives
from lightning_hpz.bench.configurations import BenchConfiguration
from lightning_hpz.bench.recording import StepRecorder
from lightning_hpz.bench.workload import Workload, build_model, rank_loader, token_set


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
    config = strategy_deepspeed_config(configuration, workload, spec["devices_per_node"])
    deepspeed.init_distributed(dist_backend="gloo")
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


def _sharded_units(model: nn.Module) -> list[nn.Module]:
    # Every parameter lives in a child unit: FSDP2 never reshards the root's own parameters after forward.
    return [model.embed, model.position, *model.blocks, model.head]


def run_fsdp2(spec: dict[str, Any], configuration: BenchConfiguration, workload: Workload) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    reshard: bool | int = spec["devices_per_node"] if configuration.hpz else True
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
