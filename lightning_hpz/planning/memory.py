"""Memory per rank of the model states under ZeRO stages 0-3 and hpZ (activations and buffers not included)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_hpz.planning.communication import ClusterLayout, ZeroSetup


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds between steps (model states only; ZeRO paper, Rajbhandari et al. 2020, sec. 5)."""

    parameters: float
    gradients: float
    optimizer_states: float
    secondary_shards: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer_states + self.secondary_shards


def memory_per_rank(
    param_count: int,
    zero: ZeroSetup,
    layout: ClusterLayout,
    param_bytes: int = 2,
    optimizer_bytes_per_param: int = 12,
    grad_bytes: int = 2,
) -> MemoryEstimate:
    """Parameters, gradients, optimizer states and hpZ secondary shards one rank holds.

    ``optimizer_bytes_per_param`` = 12 is mixed-precision Adam: fp32 master weights, momentum and variance. Stage 1
    shards the optimizer states over the world, stage 2 also the gradients, stage 3 also the parameters; hpZ adds a
    secondary copy of the parameters sharded over ``hpz_partition_size`` ranks (in ``param_bytes``), which exists from
    a module's forward to the end of the step, so it counts at the peak.
    """
    world = layout.world_size
    params, grads = param_count * param_bytes, param_count * grad_bytes
    optimizer = param_count * optimizer_bytes_per_param
    return MemoryEstimate(
        parameters=params / world if zero.stage == 3 else params,
        gradients=grads / world if zero.stage >= 2 else grads,
        optimizer_states=optimizer / world if zero.stage >= 1 else optimizer,
        secondary_shards=params / zero.hpz_partition_size if zero.stage == 3 and zero.hpz_partition_size > 1 else 0.0,
    )
