"""Gradient accumulation decided by the training loop, as Fabric loops decide it, in DeepSpeed's engine.

By default DeepSpeed owns the accumulation boundary: it counts micro-steps up to the config's
``gradient_accumulation_steps`` and reduces gradients when the count is reached, at a backward. Fabric's config has
that count at 1, so every backward was a boundary, while a Fabric loop accumulates by calling ``backward`` several
times (inside ``fabric.no_backward_sync``) before one ``optimizer.step()``. DeepSpeed 0.19 has a mode for exactly that
(``managed_gradient_accumulation: false``): backward only accumulates, and ``step()`` is the boundary. Under ZeRO 0
and 1 the reduction then happens once, at the step; under ZeRO 2 and 3 each backward still reduce-scatters into the
gradient shards (holding only a shard is what saves their memory), and the step completes the sum.

Without the mode, a Fabric loop that accumulates trains on the wrong gradient under ZeRO 1 and 2: only the last
micro-batch's gradient is kept (``tests/test_loop_owned_accumulation.py`` compares the step's gradient with DDP's).
"""

from __future__ import annotations

from typing import Any

from deepspeed.runtime.engine import DeepSpeedEngine

# the DeepSpeed config key of the mode (DeepSpeed 0.19; absent before)
LOOP_OWNED_KEY = "managed_gradient_accumulation"


def loop_owned_accumulation_available() -> bool:
    """Whether the installed DeepSpeed lets the caller own the boundary."""
    return callable(getattr(DeepSpeedEngine, LOOP_OWNED_KEY, None))


def request_loop_owned_accumulation(config: dict[str, Any]) -> bool:
    """Turn the mode on in ``config`` when the loop owns the boundary; whether it is on.

    Left as configured when the config says anything about it, and left off when the config counts micro-steps
    itself (``gradient_accumulation_steps`` > 1: the DeepSpeed way, ``optimizer.step()`` after every micro-batch).
    """
    if LOOP_OWNED_KEY in config:
        return config[LOOP_OWNED_KEY] is False
    if config.get("gradient_accumulation_steps", 1) != 1 or not loop_owned_accumulation_available():
        return False
    config[LOOP_OWNED_KEY] = False
    zero = config.get("zero_optimization") or {}
    if zero.get("stage", 0) <= 1 and zero.get("overlap_comm"):
        # DeepSpeed refuses the pair: ZeRO 0 and 1 then reduce in the step, with no backward left to overlap with
        zero["overlap_comm"] = False
    return True


def loop_owns_accumulation(engine: Any) -> bool:
    """Whether ``engine`` was built with the mode on (so that several backwards accumulate until ``step()``)."""
    managed = getattr(engine, LOOP_OWNED_KEY, None)
    return callable(managed) and not managed()
