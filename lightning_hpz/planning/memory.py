"""Memory per rank of the model states under ZeRO stages 0-3, hpZ and sharding within a group (FSDP2 HSDP, MiCS);
activations and temporaries not included."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_hpz.planning.communication import ClusterLayout, ZeroSetup


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds at the optimizer step (model states; ZeRO paper, Rajbhandari et al. 2020, sec. 5).

    ``reduce_buckets`` is ZeRO-3's gradient reduce bucket, which DeepSpeed keeps allocated for the whole run.
    ``freed_after_step`` is what the engine releases after each step (gradients of stages 0-2, hpZ secondary shards):
    measured by ``lightning-hpz study``, it is absent between steps (docs/scaling-study.md).
    """

    parameters: float
    gradients: float
    optimizer_states: float
    secondary_shards: float
    reduce_buckets: float = 0.0
    freed_after_step: float = 0.0

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer_states + self.secondary_shards + self.reduce_buckets

    @property
    def between_steps(self) -> float:
        return self.total - self.freed_after_step


def memory_per_rank(
    param_count: int,
    zero: ZeroSetup,
    layout: ClusterLayout,
    param_bytes: int = 2,
    optimizer_bytes_per_param: int = 12,
    grad_bytes: int = 2,
    reduce_bucket_elements: float = 0,
) -> MemoryEstimate:
    """Parameters, gradients, optimizer states, hpZ secondary shards and ZeRO-3's reduce bucket one rank holds.

    ``optimizer_bytes_per_param`` = 12 is mixed-precision Adam: fp32 master weights, momentum and variance (DeepSpeed
    keeps the fp32 master copy in fp32 training too). Stage 1 shards the optimizer states over the world, stage 2
    also the gradients, stage 3 also the parameters; hpZ adds a secondary copy of the parameters sharded over
    ``hpz_partition_size`` ranks (in ``param_bytes``), which exists from a module's forward to the end of the step.
    With ``zero.shard_size`` (FSDP2 HSDP, DeepSpeed MiCS) stage 3 shards all three over that many ranks instead of the
    world: each group of ``shard_size`` ranks holds a whole replica.
    ``reduce_bucket_elements``: DeepSpeed's ``reduce_bucket_size``; ZeRO-3 allocates one bucket of that many gradient
    elements at start-up and keeps it (Lightning's DeepSpeedStrategy defaults to 2e8: 381 MiB in bf16). Pass the
    elements that really occupy memory: on a GPU the whole bucket, on a CPU only the pages written (at most the model).
    """
    shards = layout.world_size if zero.shard_size is None else zero.shard_size
    params, grads = param_count * param_bytes, param_count * grad_bytes
    optimizer = param_count * optimizer_bytes_per_param
    gradients = grads / shards if zero.stage >= 2 else grads
    secondary = params / zero.hpz_partition_size if zero.stage == 3 and zero.hpz_partition_size > 1 else 0.0
    return MemoryEstimate(
        parameters=params / shards if zero.stage == 3 else params,
        gradients=gradients,
        optimizer_states=optimizer / shards if zero.stage >= 1 else optimizer,
        secondary_shards=secondary,
        reduce_buckets=reduce_bucket_elements * grad_bytes if zero.stage == 3 else 0.0,
        # ZeRO-3 keeps its gradient partitions in a persistent flat buffer; stages 0-2 drop gradients after the step.
        freed_after_step=secondary + (0.0 if zero.stage == 3 else gradients),
    )
