"""Checks that the data fits the model, run before the model is built."""

from __future__ import annotations

from typing import Optional

from transformers import PretrainedConfig

from lightning_hpz.models.architectures import max_positions


class DataModelMismatchError(ValueError):
    """The data module produces tokens or lengths the model cannot take."""


def check_data_fits_model(config: PretrainedConfig, vocab_size: Optional[int], sequence_length: Optional[int]) -> None:
    """Raise if the tokenizer's vocabulary or the sequence length exceeds what ``config`` supports."""
    if vocab_size is not None and vocab_size > config.vocab_size:
        raise DataModelMismatchError(
            f"The tokenizer has {vocab_size} tokens but the model's vocabulary has {config.vocab_size}: ids above "
            f"{config.vocab_size - 1} would index past the embedding. Use the model's own tokenizer, or a preset "
            "with a larger vocab_size."
        )
    limit = max_positions(config)
    if sequence_length is not None and limit is not None and sequence_length > limit:
        raise DataModelMismatchError(
            f"sequence_length={sequence_length} is longer than the model's {limit} positions "
            "(max_position_embeddings). Use a sequence_length of at most that."
        )
