"""Let ``fabric.setup_optimizers`` reach a DeepSpeed strategy that can build its engine in two steps.

Fabric refuses ``setup_optimizers`` for every ``DeepSpeedStrategy`` before the strategy is asked
(``Fabric._validate_setup_optimizers``, Lightning 2.6), although it is the strategy that builds the engine. A strategy
that sets ``builds_engine_in_two_steps = True`` (``HpzFabricStrategy``) is exempt from that one check; Fabric's other
checks of the call keep their meaning, in this module's words. Without that private method (another Lightning), nothing
is patched and Fabric's own refusal stands.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning.fabric import Fabric
from lightning.fabric.wrappers import _FabricOptimizer

_VALIDATOR = "_validate_setup_optimizers"


def _strategy_builds_in_two_steps(fabric: Any) -> bool:
    return getattr(fabric._strategy, "builds_engine_in_two_steps", False)


def _check_optimizers(fabric: Any, optimizers: Sequence[Any]) -> None:
    fabric._validate_launched()
    if not optimizers:
        raise ValueError("`fabric.setup_optimizers` needs the optimizer to set up: `fabric.setup_optimizers(opt)`.")
    if any(isinstance(optimizer, _FabricOptimizer) for optimizer in optimizers):
        raise ValueError("This optimizer was set up already; pass the bare optimizer once.")
    if len(optimizers) != 1:
        raise ValueError(
            f"DeepSpeed trains one optimizer per engine, got {len(optimizers)}: combine their parameter groups into "
            "one optimizer."
        )


def install() -> None:
    original = getattr(Fabric, _VALIDATOR, None)
    if original is None or getattr(original, "_lightning_hpz", False):
        return

    def validate(fabric: Any, optimizers: Sequence[Any]) -> None:
        if _strategy_builds_in_two_steps(fabric):
            _check_optimizers(fabric, optimizers)
        else:
            original(fabric, optimizers)

    validate._lightning_hpz = True  # type: ignore[attr-defined]
    setattr(Fabric, _VALIDATOR, validate)
