"""The LightningModule and data a study cell trains: any preset or study-defined model, on the package's corpora."""

from __future__ import annotations

from typing import Any

import torch

from lightning_hpz.data import CausalLMDataModule, SpanCorruptionDataModule
from lightning_hpz.models import LanguageModel
from lightning_hpz.models.architectures import hf_config, is_encoder_decoder
from lightning_hpz.models.optimization import warmup_cosine, weight_decay_groups


class StudyModel(LanguageModel):
    """:class:`~lightning_hpz.models.LanguageModel` of any family, from a family and config given as data.

    The optimizer is AdamW, or DeepSpeed's ``DeepSpeedCPUAdam`` when the strategy offloads the optimizer (DeepSpeed
    refuses a torch optimizer there). The learning rate warms up linearly over ``lr_warmup_steps``, then decays by a
    cosine to ``lr_min_ratio`` of the peak at the cell's last step (``lr_min_ratio=1``: constant after the warm-up),
    so that the losses of a short cell fall rather than swing.
    """

    def __init__(
        self,
        name: str,
        family: str,
        config: dict[str, Any],
        learning_rate: float = 1e-3,
        activation_checkpointing: bool = False,
        lr_warmup_steps: int = 0,
        lr_min_ratio: float = 1.0,
    ) -> None:
        self.family = family  # read by LanguageModel while it resolves the config
        self._model_settings = config
        super().__init__(
            preset=name,
            learning_rate=learning_rate,
            weight_decay=0.0,
            warmup_steps=lr_warmup_steps,
            min_lr_ratio=lr_min_ratio,
            activation_checkpointing=activation_checkpointing,
        )

    def _resolve_config(self, preset: Any, pretrained: Any) -> Any:
        return hf_config(self.family, self._model_settings)

    def configure_optimizers(self) -> dict[str, Any]:
        assert self.model is not None
        hp = self.hparams
        groups = weight_decay_groups(self.model, hp.weight_decay)
        zero = getattr(self.trainer.strategy, "config", {}).get("zero_optimization", {})
        if "offload_optimizer" in zero:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam(groups, lr=hp.learning_rate, betas=tuple(hp.betas))
        else:
            optimizer = torch.optim.AdamW(groups, lr=hp.learning_rate, betas=tuple(hp.betas))
        multiplier = warmup_cosine(hp.warmup_steps, float(self.trainer.max_steps), hp.min_lr_ratio)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class _Limited:
    """Mixin for a corpus data module: use only the first ``token_limit`` tokens of the corpus.

    A cell trains a few steps; span-corrupting or packing the whole corpus in every cell would cost more than that.
    """

    token_limit: int

    def token_stream(self) -> torch.Tensor:
        return super().token_stream()[: self.token_limit]  # type: ignore[misc]


class StudySpanCorruptionData(_Limited, SpanCorruptionDataModule):
    pass


class StudyCausalLMData(_Limited, CausalLMDataModule):
    pass


def study_data(family: str, data: dict[str, Any], micro_batch: int, samples: int, cache_dir: str) -> Any:
    """The data module for ``family``: span corruption (T5) or packed causal LM, with ``samples`` training examples
    (at least) and no validation split."""
    common = {
        "source": data["source"],
        "tokenizer": data["tokenizer"],
        "batch_size": micro_batch,
        "val_fraction": 0.0,
        "cache_dir": cache_dir,
    }
    if "text_field" in data:
        common["text_field"] = data["text_field"]
    length = data["sequence_length"]
    if is_encoder_decoder(family):
        module = StudySpanCorruptionData(input_length=length, **common)
        block = module.layout.raw_length
    else:
        module = StudyCausalLMData(sequence_length=length, **common)
        block = length + 1  # packing adds an end token per document; a spare token per block is plenty
    module.token_limit = (samples + 1) * block
    return module
