"""Inspect, verify and refresh the secondary (hpZ) partitions of a ZeRO-3 model.

A secondary shard is a copy of part of a parameter, taken when the parameter was last released. Anything that
writes the primary shard (``param.ds_tensor``) afterwards leaves the copy stale, and the next hpZ gather silently
serves the old weights. :func:`refresh_secondary_partitions` drops every copy, so the next gather reads the primary
shards and re-creates the copies from what it gathered (DeepSpeed does the same after each optimizer step, but only
for trainable parameters). :func:`check_secondary_partitions` rebuilds each parameter from both kinds of shard and
compares them bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_hpz import collectives
from lightning_hpz.partitioning.deepspeed_patch import active_ordering
from lightning_hpz.partitioning.sharded_parameters import is_partitioned


class SecondaryPartitionMismatchError(RuntimeError):
    """A parameter rebuilt from its secondary shards differs from the same parameter rebuilt from its primaries."""


@dataclass
class SecondaryCheckReport:
    """What :func:`check_secondary_partitions` compared, agreed over all ranks."""

    checked: int = 0
    skipped: int = 0
    mismatched: list[str] = field(default_factory=list)
    max_abs_difference: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.mismatched


def zero3_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """The parameters of ``module`` that ZeRO-3 partitioned, with their names."""
    for name, param in module.named_parameters():
        if is_partitioned(param):
            yield name, param


def has_secondary_partition(param: nn.Parameter) -> bool:
    return getattr(param, "ds_secondary_tensor", None) is not None


def count_secondary_partitions(module: nn.Module) -> int:
    return sum(has_secondary_partition(p) for _, p in zero3_parameters(module))


def refresh_secondary_partitions(module: nn.Module, gathered_only: bool = False) -> int:
    """Drop the secondary shards of ``module`` so that none can serve weights older than the primary shards.

    Call it on every rank at the same point (as you wrote the primary shards, e.g. ``param.ds_tensor``): a rank
    without secondaries gathers from the primary group, so ranks must agree. The next forward gathers from the primary
    shards once and rebuilds the secondaries from that. With ``gathered_only``, only parameters gathered right now
    (inside ``GatheredParameters``) are touched: their release rebuilds the copies on every rank, so this is safe to
    call on one rank. Returns how many shards were dropped.
    """
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    dropped = 0
    for name, param in zero3_parameters(module):
        if not has_secondary_partition(param):
            continue
        if param.ds_status == ZeroParamStatus.INFLIGHT:
            raise RuntimeError(
                f"Parameter {name!r} is being gathered right now; refresh secondary partitions between steps, "
                "not inside a forward or backward pass."
            )
        if gathered_only and param.ds_status != ZeroParamStatus.AVAILABLE:
            continue
        param.ds_secondary_tensor = None
        dropped += 1
    return dropped


def check_secondary_partitions(module: nn.Module, raise_on_mismatch: bool = True) -> SecondaryCheckReport:
    """Compare every parameter rebuilt from secondary shards with it rebuilt from primary shards, on all ranks.

    A collective: every rank of the data-parallel world must call it at the same point. Quantized secondaries
    (qwZ for frozen weights) and parameters that are not partitioned right now are skipped.
    """
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    report = SecondaryCheckReport()
    checkable = _parameters_every_rank_can_check(module, ZeroParamStatus.NOT_AVAILABLE, report)
    ordering = active_ordering()
    if ordering is not None:
        # read the shards as a gather would: after the copies that fill them (in "none" mode, possibly before)
        ordering.before_secondary_gather(p.ds_secondary_tensor for _, p in checkable)
    for name, param in checkable:
        from_secondaries = _gather_flat(param.ds_secondary_tensor, param.ds_zero_param_process_group)
        from_primaries = _gather_flat(param.ds_tensor, param.ds_process_group)
        numel = param.ds_numel
        if not torch.equal(from_secondaries[:numel], from_primaries[:numel]):
            report.mismatched.append(name)
            difference = (from_secondaries[:numel].double() - from_primaries[:numel].double()).abs()
            report.max_abs_difference[name] = float(torch.nan_to_num(difference, nan=float("inf")).max())
        report.checked += 1
    _agree_over_ranks(report, order=[name for name, _ in checkable])
    if raise_on_mismatch and not report.ok:
        raise SecondaryPartitionMismatchError(_describe_mismatch(report))
    return report


def _parameters_every_rank_can_check(
    module: nn.Module, partitioned_status: object, report: SecondaryCheckReport
) -> list[tuple[str, nn.Parameter]]:
    # Gathers are collectives: only parameters that every rank can check take part, in one agreed order.
    candidates = list(zero3_parameters(module))
    local = [
        has_secondary_partition(p)
        and p.ds_status == partitioned_status
        and not hasattr(p.ds_secondary_tensor, "ds_quant_scale")
        for _, p in candidates
    ]
    flags = collectives.all_reduce(torch.tensor(local, dtype=torch.int32), op="min")
    report.skipped = sum(has_secondary_partition(p) for _, p in candidates) - int(flags.sum())
    return [candidate for candidate, flag in zip(candidates, flags.tolist(), strict=True) if flag]


def _gather_flat(shard: torch.Tensor, group: object) -> torch.Tensor:
    return torch.cat(collectives.all_gather_tensor(shard.detach().reshape(-1), group=group))


def _agree_over_ranks(report: SecondaryCheckReport, order: list[str]) -> None:
    per_rank: list[dict[str, float]] = collectives.all_gather_object(report.max_abs_difference)
    merged: dict[str, float] = {}
    for differences in per_rank:
        for name, value in (differences or {}).items():
            merged[name] = max(value, merged.get(name, 0.0))
    report.max_abs_difference = merged
    report.mismatched = [name for name in order if name in merged]


def _describe_mismatch(report: SecondaryCheckReport, shown: int = 5) -> str:
    listed = ", ".join(
        f"{name} (max |diff| {report.max_abs_difference[name]:.3g})" for name in report.mismatched[:shown]
    )
    more = f" and {len(report.mismatched) - shown} more" if len(report.mismatched) > shown else ""
    return (
        f"hpZ secondary partitions disagree with the primary partitions for {len(report.mismatched)} of "
        f"{report.checked} parameters: {listed}{more}. The secondary copies are stale or were read before their copy "
        "finished. Call `lightning_hpz.refresh_secondary_partitions(model)` after writing primary shards, and use "
        "hpz_sync='event' or 'stream'."
    )
