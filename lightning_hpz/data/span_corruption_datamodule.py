"""T5 pre-training data: packed raw blocks, span-corrupted into exact-length inputs and targets."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Dataset

from lightning_hpz.data.corpus import DEFAULT_CORPUS
from lightning_hpz.data.corpus_datamodule import DEFAULT_CACHE_DIR, CorpusDataModule
from lightning_hpz.data.packing import PackedBlocks
from lightning_hpz.data.prepared_shards import PreparedShards
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
        errors: str = "strict",
    ) -> None:
        super().__init__(source, tokenizer, batch_size, val_fraction, text_field, cache_dir, seed, errors)
        self.layout = raw_length_for(input_length, noise_density, mean_span_length)
        self.noise_density = noise_density
        self.mean_span_length = mean_span_length
        self.sentinels = self.tokenizer.sentinel_ids(self.layout.spans)

    @property
    def sequence_length(self) -> int:
        return self.layout.input_length

    @property
    def sequence_tokens(self) -> int:
        return self.layout.raw_length

    def build_datasets(self, shards: PreparedShards) -> tuple[SpanCorruptedExamples, SpanCorruptedExamples]:
        count = self.examples_in_stream()
        split = self.split_point(count)
        corrupt = self._corrupt
        return (
            SpanCorruptedExamples(PackedBlocks(shards, self.layout.raw_length, 0, split), 0, corrupt),
            SpanCorruptedExamples(PackedBlocks(shards, self.layout.raw_length, split, count - split), split, corrupt),
        )

    def _corrupt(self, index: int, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return corrupt_spans(
            block, self.sentinels, self.tokenizer.eos_id, generator, self.noise_density, self.mean_span_length
        )


class SpanCorruptedExamples(Dataset):
    """Blocks corrupted on access; block ``b`` of the whole stream always gets the same corruption (seeded by ``b``)."""

    def __init__(
        self,
        blocks: PackedBlocks,
        first: int,
        corrupt: Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        self.blocks, self.first, self.corrupt = blocks, first, corrupt

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, Any]:
        inputs, targets = self.corrupt(self.first + index, self.blocks.block(index))
        return {"sample_index": index, "input_ids": inputs, "labels": targets}
