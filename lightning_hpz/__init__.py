"""lightning_hpz: ZeRO training with stabilized hierarchical partitioning (hpZ) as ``Trainer(strategy="hpz")``."""

from lightning_hpz.config import HpzConfigurationError
from lightning_hpz.partitioning import (
    SecondaryPartitionMismatchError,
    check_secondary_partitions,
    refresh_secondary_partitions,
)
from lightning_hpz.strategy import STRATEGY_PRESETS, HpzStrategy, register

__version__ = "0.1.0"

register()

__all__ = [
    "STRATEGY_PRESETS",
    "HpzConfigurationError",
    "HpzStrategy",
    "SecondaryPartitionMismatchError",
    "__version__",
    "check_secondary_partitions",
    "refresh_secondary_partitions",
]
