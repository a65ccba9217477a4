"""``fabric.no_backward_sync`` for ``HpzFabricStrategy``: accumulation until ``optimizer.step()``.

With the loop owning the accumulation boundary (:mod:`lightning_hpz.partitioning.loop_owned_accumulation`), a backward
under ZeRO 0 and 1 only accumulates; under ZeRO 2 and 3 it reduce-scatters into the gradient shards, which those
stages need to hold only their shard. Either way the step sums what the skipped syncs accumulated, so there is nothing
to switch. An engine that counts micro-steps itself would keep only the last micro-batch's gradient: refused.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from lightning_hpz import partitioning
from lightning_hpz.lightning_internals import BackwardSyncControl
from lightning_hpz.strategy.deferred_engine import DeferredEngine


class AccumulateUntilStep(BackwardSyncControl):
    def no_backward_sync(self, module: Any, enabled: bool) -> AbstractContextManager:
        engine = module.built_engine() if isinstance(module, DeferredEngine) else module
        if enabled and not partitioning.loop_owned_accumulation_available():
            raise ValueError(
                "`fabric.no_backward_sync` accumulates over several backwards until `optimizer.step()`, which "
                "DeepSpeed supports from 0.19.4 on (`managed_gradient_accumulation: false`); the installed DeepSpeed "
                "would keep only the last micro-batch's gradient. Install a newer release "
                '(`pip install "deepspeed>=0.19.5"`), or call `optimizer.step()` after every micro-batch.'
            )
        if enabled and not partitioning.loop_owns_accumulation(engine):
            raise ValueError(
                "`fabric.no_backward_sync` accumulates over several backwards, which this engine does not do: its "
                "DeepSpeed config sets `managed_gradient_accumulation: true` or `gradient_accumulation_steps` > 1. "
                "Remove those settings (the loop then owns the boundary), or call `optimizer.step()` after every "
                "micro-batch and let DeepSpeed count them."
            )
        return nullcontext()


ACCUMULATE_UNTIL_STEP = AccumulateUntilStep()
