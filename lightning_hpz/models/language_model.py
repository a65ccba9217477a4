"""``LanguageModel``: a LightningModule around a transformers model, built inside ``configure_model``.

The model file knows nothing of DeepSpeed: under ZeRO-3, Lightning calls ``configure_model`` inside the strategy's
sharded context (``deepspeed.zero.Init``), so every layer is partitioned as soon as it is built and the full model
never exists on one rank.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
from torchmetrics.text import Perplexity
from transformers import PretrainedConfig

from lightning_hpz.lightning_internals import attached_trainer
from lightning_hpz.models.architectures import build_hf_model, hf_config, is_encoder_decoder
from lightning_hpz.models.compatibility import check_data_fits_model
from lightning_hpz.models.initialization_by_name import draw_seed, initialize_by_name, name_seed
from lightning_hpz.models.optimization import warmup_cosine, weight_decay_groups
from lightning_hpz.models.presets import get_preset
from lightning_hpz.models.pretrained import export_pretrained, load_pretrained_weights, read_pretrained_config
from lightning_hpz.models.sharded_weights import initialize_partitioned_weights

MODEL_INPUTS = ("input_ids", "attention_mask", "labels", "decoder_input_ids")
IGNORE_INDEX = -100


class LanguageModel(L.LightningModule):
    """Pre-training / fine-tuning of one model family; use :class:`Llama2`, :class:`Falcon` or :class:`T5`.

    Args:
        preset: a name from ``lightning-hpz presets`` (e.g. ``"llama2-7b"``); ignored when ``pretrained`` is given.
        pretrained: local directory of a Hugging Face model (config.json + safetensors) to start from.
        learning_rate: peak AdamW learning rate.
        weight_decay: AdamW weight decay of matrices (norms, biases and embeddings get none).
        betas: AdamW betas.
        warmup_steps: linear warmup steps, then cosine decay to ``min_lr_ratio`` of the peak at the last step.
        min_lr_ratio: final learning rate as a share of the peak.
        activation_checkpointing: recompute each layer's activations in backward instead of storing them.
        export_dir: where to write the trained model as a Hugging Face directory when training ends.
        layout_independent_init: draw each module's initial weights from a generator seeded with (seed, its name),
            and leave torch's generator in a state set by the seed alone after the build, so that the same seed gives
            bit-identical weights (and dropout) under ZeRO-1, 2, 3, any hpZ size and any number of ranks. False:
            transformers' own draws, which under ZeRO-3 come in another order and give another model. Default True.
    """

    family = ""

    def __init__(
        self,
        preset: Optional[str] = None,
        pretrained: Optional[str] = None,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 100,
        min_lr_ratio: float = 0.1,
        activation_checkpointing: bool = False,
        export_dir: Optional[str] = None,
        layout_independent_init: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.hf_config = self._resolve_config(preset, pretrained)
        self.model: Optional[torch.nn.Module] = None
        self.val_perplexity = Perplexity(ignore_index=IGNORE_INDEX)

    def _resolve_config(self, preset: Optional[str], pretrained: Optional[str]) -> PretrainedConfig:
        if pretrained is not None:
            family, config = read_pretrained_config(pretrained)
        elif preset is not None:
            chosen = get_preset(preset)
            family, config = chosen.family, hf_config(chosen.family, chosen.config)
        else:
            raise ValueError(f"{type(self).__name__} needs `preset=` (see `lightning-hpz presets`) or `pretrained=`.")
        if family != self.family:
            source = f"pretrained={pretrained!r}" if pretrained is not None else f"preset={preset!r}"
            raise ValueError(f"{source} is a {family} model; {type(self).__name__} trains {self.family} models.")
        return config

    # ----------------------------------------------------------------------------------------------- building
    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None) if attached_trainer(self) is not None else None
        if datamodule is not None:
            vocab = getattr(datamodule, "vocab_size", None)
            check_data_fits_model(self.hf_config, vocab, getattr(datamodule, "sequence_length", None))

    def configure_model(self) -> None:
        if self.model is not None:
            return
        # Drawn before the build: ZeRO-1/2 and ZeRO-3 builds consume torch's generator differently from here on.
        seed = draw_seed() if self.hparams.layout_independent_init else None
        self.model = build_hf_model(self.family, self.hf_config)
        self._initialize_weights(seed)
        if self.hparams.activation_checkpointing:
            self._enable_activation_checkpointing()

    def _initialize_weights(self, seed: Optional[int]) -> None:
        assert self.model is not None
        if self.hparams.pretrained is not None:
            load_pretrained_weights(self.model, self.hparams.pretrained)
        elif seed is not None:
            initialize_by_name(self.model, seed=seed)
        else:
            initialize_partitioned_weights(self.model)  # no-op unless zero.Init partitioned the layers as built
        if seed is not None:
            torch.manual_seed(name_seed(seed, "after the build"))  # dropout then draws alike under every layout

    def _enable_activation_checkpointing(self) -> None:
        # transformers 5 renamed gradient_checkpointing_enable (deprecated there; 4.x has only the old name).
        kwargs = {"use_reentrant": False}  # the reentrant variant drops gradients of inputs that need none
        if hasattr(self.model, "activation_checkpointing_enable"):
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

    # ----------------------------------------------------------------------------------------------- steps
    def forward(self, **inputs: torch.Tensor) -> Any:
        assert self.model is not None, "call configure_model() first (the Trainer does)"
        return self.model(**inputs)

    def _model_inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {key: batch[key] for key in MODEL_INPUTS if key in batch}

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self(**self._model_inputs(batch)).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        output = self(**self._model_inputs(batch))
        logits, labels = output.logits, batch["labels"]
        if not is_encoder_decoder(self.family):
            logits, labels = logits[:, :-1], labels[:, 1:]  # token t predicts token t+1
        self.val_perplexity.update(logits.float(), labels)
        self.log("val_loss", output.loss, sync_dist=True)
        self.log("val_perplexity", self.val_perplexity, prog_bar=True)

    # ----------------------------------------------------------------------------------------------- optimizer
    def configure_optimizers(self) -> dict[str, Any]:
        assert self.model is not None
        hp = self.hparams
        optimizer = torch.optim.AdamW(
            weight_decay_groups(self.model, hp.weight_decay), lr=hp.learning_rate, betas=tuple(hp.betas)
        )
        total = float(self.trainer.estimated_stepping_batches)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(hp.warmup_steps, total, hp.min_lr_ratio))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    # ----------------------------------------------------------------------------------------------- export
    def on_train_end(self) -> None:
        if self.hparams.export_dir is not None:
            self.export(self.hparams.export_dir)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # what `lightning-hpz export` rebuilds the transformers model and its tokenizer from
        datamodule = getattr(self.trainer, "datamodule", None) if attached_trainer(self) is not None else None
        checkpoint["huggingface_export"] = {
            "family": self.family,
            "config": self.hf_config.to_dict(),
            "tokenizer": getattr(datamodule, "tokenizer_spec", None),
        }

    def export(self, directory: str) -> None:
        """Write the current weights as a Hugging Face directory (a collective under ZeRO-3: call on all ranks)."""
        assert self.model is not None
        export_pretrained(self.model, directory)


class Llama2(LanguageModel):
    """Llama-2 (decoder-only: RoPE, RMSNorm, SwiGLU; grouped-query attention in 70B)."""

    family = "llama2"


class Falcon(LanguageModel):
    """Falcon (decoder-only; 7B multi-query attention, 40B/180B the new decoder architecture)."""

    family = "falcon"


class T5(LanguageModel):
    """T5 v1.1 / mT5 encoder-decoder with gated-GELU feed-forward, trained with span corruption."""

    family = "t5"
