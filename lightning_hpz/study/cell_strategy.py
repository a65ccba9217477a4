"""What a grid's strategy name means: the registered :data:`~lightning_hpz.strategy.presets.STRATEGY_PRESETS` entry
it is, its ZeRO stage, whether it uses hpZ, and what it offloads to host memory."""

from __future__ import annotations

from typing import Any

from lightning_hpz.strategy.presets import STRATEGY_PRESETS  # plain data: no torch or Lightning import


def _presets() -> dict[str, dict[str, Any]]:
    return {name: dict(kwargs) for name, _, kwargs in STRATEGY_PRESETS}


def strategy_names() -> list[str]:
    return list(_presets())


def strategy_kwargs(name: str) -> dict[str, Any]:
    """The ``HpzStrategy`` arguments registered under ``name``."""
    return dict(_presets()[name])


def zero_stage(name: str) -> int:
    return strategy_kwargs(name).get("stage", 3)  # HpzStrategy's default stage is 3


def uses_hpz(name: str) -> bool:
    """Registered with hpZ on (its size left to 'auto' or the grid), as ``hpz``, ``hpz_offload`` and ``zeropp`` are."""
    kwargs = strategy_kwargs(name)
    return zero_stage(name) == 3 and kwargs.get("hpz_partition_size", "auto") != 1


def offloads_optimizer(name: str) -> bool:
    return bool(strategy_kwargs(name).get("offload_optimizer", False))


def offloads_parameters(name: str) -> bool:
    return bool(strategy_kwargs(name).get("offload_parameters", False))
