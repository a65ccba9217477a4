"""lightning_hpz: ZeRO with stabilized hierarchical partitioning (hpZ) as ``strategy="hpz"`` for Trainer and Fabric.

Importing the package is cheap (no torch, Lightning or DeepSpeed): the public names load on first use, and the
strategy names are registered with Lightning as soon as Lightning is imported (:mod:`lightning_hpz.registration`).
"""

import importlib
from typing import Any

from lightning_hpz.registration import register_when_lightning_is_imported
from lightning_hpz.strategy_presets import STRATEGY_PRESETS

__version__ = "0.1.0"

# public name -> module that defines it, imported on first access
_LAZY_ATTRIBUTES = {
    "HpzConfigurationError": "lightning_hpz.config",
    "HpzFabricStrategy": "lightning_hpz.fabric",
    "HpzStrategy": "lightning_hpz.strategy",
    "SecondaryPartitionMismatchError": "lightning_hpz.partitioning",
    "check_secondary_partitions": "lightning_hpz.partitioning",
    "refresh_secondary_partitions": "lightning_hpz.partitioning",
}

register_when_lightning_is_imported()


def __getattr__(name: str) -> Any:
    if name not in _LAZY_ATTRIBUTES:
        raise AttributeError(f"module 'lightning_hpz' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY_ATTRIBUTES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY_ATTRIBUTES])


__all__ = [
    "STRATEGY_PRESETS",
    "HpzConfigurationError",
    "HpzFabricStrategy",
    "HpzStrategy",
    "SecondaryPartitionMismatchError",
    "__version__",
    "check_secondary_partitions",
    "refresh_secondary_partitions",
]
