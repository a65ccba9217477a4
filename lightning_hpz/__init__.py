"""lightning_hpz: ZeRO with stabilized hierarchical partitioning (hpZ) as ``strategy="hpz"`` for Trainer and Fabric.

Importing the package is cheap (no torch, Lightning or DeepSpeed): the public names load on first use, and the
strategy names are registered with Lightning as soon as Lightning is imported
(:mod:`lightning_hpz.strategy.registration`).
"""

from lightning_hpz.lazy_names import lazy_names
from lightning_hpz.strategy.presets import STRATEGY_PRESETS
from lightning_hpz.strategy.registration import register_when_lightning_is_imported

__version__ = "0.1.0"

# public name -> the subpackage that exposes it (itself lazily: `strategy/__init__.py` knows the defining module)
_LAZY_ATTRIBUTES = {
    "HpzConfigurationError": "strategy",
    "HpzFabricStrategy": "strategy",
    "HpzStrategy": "strategy",
    "SecondaryPartitionMismatchError": "partitioning",
    "check_secondary_partitions": "partitioning",
    "initialize_by_name": "models",
    "refresh_secondary_partitions": "partitioning",
}
__getattr__, __dir__ = lazy_names(__name__, _LAZY_ATTRIBUTES)

register_when_lightning_is_imported()


__all__ = [
    "STRATEGY_PRESETS",
    "HpzConfigurationError",
    "HpzFabricStrategy",
    "HpzStrategy",
    "SecondaryPartitionMismatchError",
    "__version__",
    "check_secondary_partitions",
    "initialize_by_name",
    "refresh_secondary_partitions",
]
