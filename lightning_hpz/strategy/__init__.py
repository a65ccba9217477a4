"""The strategies: :class:`HpzStrategy` for the Trainer and :class:`HpzFabricStrategy` for Fabric, over one shared
set-up (:class:`~lightning_hpz.strategy.hpz_setup.HpzSetup`), their DeepSpeed config, and the registered names.

Importing this package is cheap (no torch, Lightning or DeepSpeed): the names below load their module on first use,
and :mod:`~lightning_hpz.strategy.registration` registers the strategy names once Lightning is imported.
"""

from lightning_hpz.lazy_names import lazy_names

# public name -> the module of this package that defines it, imported on first access
_LAZY_ATTRIBUTES = {
    "HpzConfigurationError": "config",
    "HpzFabricStrategy": "fabric_strategy",
    "HpzSetup": "hpz_setup",
    "HpzStrategy": "trainer_strategy",
}
__getattr__, __dir__ = lazy_names(__name__, _LAZY_ATTRIBUTES)

__all__ = ["HpzConfigurationError", "HpzFabricStrategy", "HpzSetup", "HpzStrategy"]
