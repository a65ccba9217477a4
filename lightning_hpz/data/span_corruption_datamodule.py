"""T5 pre-training data: packed raw blocks, span-corrupted into exact-length inputs and targets."""

from __future__ import annotations

import torch

from lightning_hpz.data.corpus import DEFAULT_CORPUS
from lightning_hpz.data.corpus_datamodule import DEFAULT_CACHE_DIR, CorpusDataModule, TensorExamples
from lightning_hpz.data.packing import pack_tokens
from lightning_hpz.data.span_corruption import MEAN_SPAN_LENGTH, NOISE_DENSITY, corrupt_spans, raw_length_for


class SpanCorruptionDataModule(CorpusDataModule):
    """Span corruption (T5): every example has exactly ``input_length`` input and a fixed number of target tokens.

    The corruption of each block is drawn once from ``seed`` and the block's index, so it is the same on every rank
    and in every run.

    Args:
        input_length: encoder tokens per example; the raw block length is chosen so that this fits exactly.
        noise_density: share of raw tokens masked (T5: 0.15).
        mean_span_length: mean length of a masked span (T5: 3).
        Others: see :class:`~lightning_hpz.data.corpus_datamodule.CorpusDataModule`.
    """

    def __init__(
        self,
        source: str = DEFAULT_CORPUS,
        tokenizer: str = "byte",
        input_length: int = 128,
        noise_density: float = NOISE_DENSITY,
        mean_span_length: float = MEAN_SPAN_LENGTH,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        text_field: str = "text",
        cache_dir: str = DEFAULT_CACHE_DIR,
        seed: int = 0,
    ) -> None:
        super().__init__(source, tokenizer, batch_size, val_fraction, text_field, cache_dir, seed)
        self.layout = raw_length_for(input_length, noise_density, mean_span_length)
        self.noise_density = noise_density
        self.mean_span_length = mean_span_length
        self.sentinels = self.tokenizer.sentinel_ids(self.layout.spans)

    @property
    def sequence_length(self) -> int:
        return self.layout.input_length

    def build_datasets(self, tokens: torch.Tensor) -> tuple[TensorExamples, TensorExamples]:
        blocks = pack_tokens(tokens, self.layout.raw_length)
        pairs = [self._corrupt(index, block) for index, block in enumerate(blocks)]
        inputs = torch.stack([i for i, _ in pairs])  # (N, input_length)
        targets = torch.stack([t for _, t in pairs])  # (N, target_length)
        split = self.split_point(len(blocks))
        return (
            TensorExamples(input_ids=inputs[:split], labels=targets[:split]),
            TensorExamples(input_ids=inputs[split:], labels=targets[split:]),
        )

    def _corrupt(self, index: int, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return corrupt_spans(
            block, self.sentinels, self.tokenizer.eos_id, generator, self.noise_density, self.mean_span_length
        )
