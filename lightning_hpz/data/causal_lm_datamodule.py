"""Causal language modelling: the token stream packed into fixed-length sequences."""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset

from lightning_hpz.data.corpus import DEFAULT_CORPUS
from lightning_hpz.data.corpus_datamodule import DEFAULT_CACHE_DIR, CorpusDataModule
from lightning_hpz.data.packing import PackedBlocks
from lightning_hpz.data.prepared_shards import PreparedShards


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
        errors: str = "strict",
    ) -> None:
        super().__init__(source, tokenizer, batch_size, val_fraction, text_field, cache_dir, seed, errors)
        self._sequence_length = sequence_length

    @property
    def sequence_length(self) -> int:
        return self._sequence_length

    def build_datasets(self, shards: PreparedShards) -> tuple[CausalExamples, CausalExamples]:
        count = self.examples_in_stream()
        split = self.split_point(count)
        return (
            CausalExamples(PackedBlocks(shards, self.sequence_length, 0, split)),
            CausalExamples(PackedBlocks(shards, self.sequence_length, split, count - split)),
        )


class CausalExamples(Dataset):
    """Packed blocks as causal-LM examples: the model shifts labels by one itself (transformers), so labels = inputs."""

    def __init__(self, blocks: PackedBlocks) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, Any]:
        block = self.blocks.block(index)
        return {"sample_index": index, "input_ids": block, "labels": block}
