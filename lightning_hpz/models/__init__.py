"""Llama-2, Falcon and T5 LightningModules on transformers architectures, with named size presets.

The names load on first use, so ``lightning-hpz presets`` (which needs only the preset table) imports no torch.
"""

import importlib
from typing import Any

# public name -> module that defines it
_LAZY_ATTRIBUTES = {
    "DataModelMismatchError": "lightning_hpz.models.compatibility",
    "check_data_fits_model": "lightning_hpz.models.compatibility",
    "T5": "lightning_hpz.models.language_model",
    "Falcon": "lightning_hpz.models.language_model",
    "LanguageModel": "lightning_hpz.models.language_model",
    "Llama2": "lightning_hpz.models.language_model",
    "PRESETS": "lightning_hpz.models.presets",
    "ModelPreset": "lightning_hpz.models.presets",
    "UnknownPresetError": "lightning_hpz.models.presets",
    "count_parameters": "lightning_hpz.models.presets",
    "get_preset": "lightning_hpz.models.presets",
    "PretrainedModelError": "lightning_hpz.models.pretrained",
    "export_pretrained": "lightning_hpz.models.pretrained",
    "load_pretrained_weights": "lightning_hpz.models.pretrained",
    "TrainingSummary": "lightning_hpz.models.training_summary",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY_ATTRIBUTES:
        raise AttributeError(f"module 'lightning_hpz.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY_ATTRIBUTES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY_ATTRIBUTES])


__all__ = sorted(_LAZY_ATTRIBUTES)
