"""Causal language modelling: the token stream packed into fixed-length sequences."""

from __future__ import annotations

import torch

from lightning_hpz.data.corpus import DEFAULT_CORPUS
from lightning_hpz.data.corpus_datamodule import DEFAULT_CACHE_DIR, CorpusDataModule, TensorExamples
from lightning_hpz.data.packing import pack_tokens


class CausalLMDataModule(CorpusDataModule):
    """Next-token prediction on packed sequences of ``sequence_length`` tokens (documents joined by end tokens).

    Args:
        sequence_length: tokens per example; must not exceed the model's positions.
        Others: see :class:`~lightning_hpz.data.corpus_datamodule.CorpusDataModule`.
    """

    def __init__(
        self,
        source: str = DEFAULT_CORPUS,
        tokenizer: str = "byte",
        sequence_length: int = 128,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        text_field: str = "text",
        cache_dir: str = DEFAULT_CACHE_DIR,
        seed: int = 0,
    ) -> None:
        super().__init__(source, tokenizer, batch_size, val_fraction, text_field, cache_dir, seed)
        self._sequence_length = sequence_length

    @property
    def sequence_length(self) -> int:
        return self._sequence_length

    def build_datasets(self, tokens: torch.Tensor) -> tuple[TensorExamples, TensorExamples]:
        blocks = pack_tokens(tokens, self.sequence_length)  # (N, T)
        split = self.split_point(len(blocks))
        # The model shifts labels by one itself (transformers convention), so labels are the inputs.
        return (
            TensorExamples(input_ids=blocks[:split], labels=blocks[:split]),
            TensorExamples(input_ids=blocks[split:], labels=blocks[split:]),
        )
