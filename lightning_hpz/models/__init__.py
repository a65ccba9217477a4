"""Llama-2, Falcon and T5 LightningModules on transformers architectures, with named size presets.

The names load on first use, so ``lightning-hpz presets`` (which needs only the preset table) imports no torch.
"""

from lightning_hpz.lazy_names import lazy_names

# public name -> the module that defines it
_LAZY_ATTRIBUTES = {
    "DataModelMismatchError": "compatibility",
    "check_data_fits_model": "compatibility",
    "T5": "language_model",
    "Falcon": "language_model",
    "LanguageModel": "language_model",
    "Llama2": "language_model",
    "PRESETS": "presets",
    "ModelPreset": "presets",
    "UnknownPresetError": "presets",
    "count_parameters": "presets",
    "get_preset": "presets",
    "initialize_by_name": "initialization_by_name",
    "PretrainedModelError": "pretrained",
    "export_pretrained": "pretrained",
    "load_pretrained_weights": "pretrained",
    "TrainingSummary": "training_summary",
}

__getattr__, __dir__ = lazy_names(__name__, _LAZY_ATTRIBUTES)


__all__ = sorted(_LAZY_ATTRIBUTES)
