"""lightning_hpz: ZeRO with stabilized hierarchical partitioning (hpZ) as ``strategy="hpz"`` for Trainer and Fabric."""

import os

import torch

# Without a GPU, tell DeepSpeed so before it is imported: it then skips probing for one (and warning about it).
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

from lightning_hpz import fabric
from lightning_hpz.config import HpzConfigurationError
from lightning_hpz.fabric import HpzFabricStrategy
from lightning_hpz.hpz_setup import STRATEGY_PRESETS
from lightning_hpz.partitioning import (
    SecondaryPartitionMismatchError,
    check_secondary_partitions,
    refresh_secondary_partitions,
)
from lightning_hpz.strategy import HpzStrategy, register

__version__ = "0.1.0"

register()
fabric.register()

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
