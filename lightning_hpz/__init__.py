"""lightning_hpz: ZeRO training with stabilized hierarchical partitioning (hpZ) as ``Trainer(strategy="hpz")``."""

import os
from typing import Any

import torch

# Without a GPU, tell DeepSpeed so before it is imported: it then skips probing for one (and warning about it).
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

from lightning_hpz.config import HpzConfigurationError
from lightning_hpz.strategy import STRATEGY_PRESETS, HpzStrategy, register

__version__ = "0.1.0"

# Registering names has no side effect on DeepSpeed: it is neither imported nor patched until a strategy is set up.
register()

_FROM_PARTITIONING = ("SecondaryPartitionMismatchError", "check_secondary_partitions", "refresh_secondary_partitions")


def __getattr__(name: str) -> Any:
    # These need DeepSpeed; loaded on first use so that `import lightning_hpz` works without it.
    if name in _FROM_PARTITIONING:
        from lightning_hpz import partitioning

        return getattr(partitioning, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "STRATEGY_PRESETS",
    "HpzConfigurationError",
    "HpzStrategy",
    "SecondaryPartitionMismatchError",
    "__version__",
    "check_secondary_partitions",
    "refresh_secondary_partitions",
]
