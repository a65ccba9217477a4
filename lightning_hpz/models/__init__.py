"""Llama-2, Falcon and T5 LightningModules on transformers architectures, with named size presets."""

from lightning_hpz.models.compatibility import DataModelMismatchError, check_data_fits_model
from lightning_hpz.models.language_model import T5, Falcon, LanguageModel, Llama2
from lightning_hpz.models.presets import PRESETS, ModelPreset, UnknownPresetError, count_parameters, get_preset
from lightning_hpz.models.pretrained import PretrainedModelError, export_pretrained, load_pretrained_weights
from lightning_hpz.models.training_summary import TrainingSummary

__all__ = [
    "PRESETS",
    "T5",
    "DataModelMismatchError",
    "Falcon",
    "LanguageModel",
    "Llama2",
    "ModelPreset",
    "PretrainedModelError",
    "TrainingSummary",
    "UnknownPresetError",
    "check_data_fits_model",
    "count_parameters",
    "export_pretrained",
    "get_preset",
    "load_pretrained_weights",
]
