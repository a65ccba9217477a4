"""The Hugging Face transformers classes each model family is built from, so real checkpoints load unchanged."""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import (
    FalconConfig,
    FalconForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MT5Config,
    MT5ForConditionalGeneration,
    PretrainedConfig,
)

try:  # transformers 5: init functions that leave a tensor loaded by from_pretrained (flagged) untouched
    from transformers import initialization as _guarded_init
except ImportError:  # transformers 4 initialises with torch's own functions
    from torch.nn import init as _guarded_init

FAMILIES = ("llama2", "falcon", "t5")


class UntiedT5ForConditionalGeneration(MT5ForConditionalGeneration):
    """T5 v1.1 / mT5 as published: gated-GELU, no decoder-output scaling, and an output projection of its own.

    transformers 5 ties ``lm_head`` to the input embedding for every freshly built T5 (it unties only when a loaded
    checkpoint disagrees); the released T5 v1.1 and mT5 checkpoints have a separate ``lm_head``. Here encoder and
    decoder share the input embedding, as in the originals, and ``lm_head`` stays a separate matrix.
    """

    _tied_weights_keys = {
        "encoder.embed_tokens.weight": "shared.weight",
        "decoder.embed_tokens.weight": "shared.weight",
    }

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if module is self and self.lm_head.weight is not self.shared.weight:  # (the config says tied whatever)
            # transformers draws the untied output projection with std 1 (a generic Linear, initializer_factor), which
            # starts pre-training at a loss of 36-84 instead of ln(vocabulary); T5's own trainer (t5x) scales it by
            # fan-in. Only a model built from scratch gets here: loaded weights are copied over it.
            std = self.config.initializer_factor * self.config.d_model**-0.5
            _guarded_init.normal_(self.lm_head.weight, mean=0.0, std=std)


_CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {"llama2": LlamaConfig, "falcon": FalconConfig, "t5": MT5Config}
_MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama2": LlamaForCausalLM,
    "falcon": FalconForCausalLM,
    "t5": UntiedT5ForConditionalGeneration,
}
# config.model_type of a local checkpoint -> family
MODEL_TYPES = {"llama": "llama2", "falcon": "falcon", "t5": "t5", "mt5": "t5"}


def hf_config(family: str, settings: dict[str, Any]) -> PretrainedConfig:
    """The transformers config of ``family`` with ``settings`` (config keyword arguments)."""
    return _CONFIG_CLASSES[family](**settings)


def build_hf_model(family: str, config: PretrainedConfig) -> nn.Module:
    """A freshly initialised transformers model of ``family``: allocates on the current device / init context."""
    return _MODEL_CLASSES[family](config)


def is_encoder_decoder(family: str) -> bool:
    return family == "t5"


def max_positions(config: PretrainedConfig) -> int | None:
    """The longest sequence the model's position encoding supports, or None where it has no limit (T5)."""
    if getattr(config, "is_encoder_decoder", False):
        return None  # relative position buckets: any length
    return getattr(config, "max_position_embeddings", None)
