"""Shared base of the data modules: read a corpus, tokenize it once (cached), split, shard across ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_hpz.data.corpus import DEFAULT_CORPUS, read_corpus
from lightning_hpz.data.token_cache import cached_token_stream
from lightning_hpz.data.tokenizers import Tokenizer, load_tokenizer

DEFAULT_CACHE_DIR = ".cache/lightning_hpz/tokens"


class CorpusDataModule(L.LightningDataModule):
    """Reads ``source``, tokenizes it on local rank 0 into a cache, and serves fixed-length examples.

    Subclasses say how the token stream becomes examples (:meth:`build_datasets`).

    Args:
        source: ``"default"`` (the embedded CPython help text), ``"default+stdlib"`` (plus the standard library's
            source), or a local .txt / .jsonl / .parquet file or datasets directory.
        tokenizer: ``"byte"`` (default) or the local directory of a Hugging Face tokenizer.
        batch_size: examples per rank per step.
        val_fraction: share of the packed examples held out (the corpus's tail, so no text is in both splits).
        text_field: field (.jsonl) or column (.parquet, datasets) holding the text.
        cache_dir: where token streams are cached, keyed by corpus content and tokenizer.
        seed: seed of the per-epoch shuffle (the epoch is added, so each epoch has its own, reproducible order).
    """

    def __init__(
        self,
        source: str = DEFAULT_CORPUS,
        tokenizer: str = "byte",
        batch_size: int = 8,
        val_fraction: float = 0.05,
        text_field: str = "text",
        cache_dir: str = DEFAULT_CACHE_DIR,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must be in [0, 1).")
        self.source = source
        self.tokenizer_spec = tokenizer
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.text_field = text_field
        self.cache_dir = Path(cache_dir)
        self.seed = seed
        self.tokenizer: Tokenizer = load_tokenizer(tokenizer)
        self.train_set: Optional[Dataset] = None
        self.val_set: Optional[Dataset] = None

    @property
    def vocab_size(self) -> int:
        """Size of the tokenizer's vocabulary: the model's must be at least this large."""
        return self.tokenizer.vocab_size

    @property
    def sequence_length(self) -> int:
        """The longest sequence the model receives (checked against its positions)."""
        raise NotImplementedError

    def token_stream(self) -> torch.Tensor:
        return cached_token_stream(read_corpus(self.source, self.text_field), self.tokenizer, self.cache_dir)

    def prepare_data(self) -> None:
        self.token_stream()  # local rank 0 only: tokenizes once and writes the cache the other ranks read

    def setup(self, stage: str) -> None:
        if self.train_set is None:
            self.train_set, self.val_set = self.build_datasets(self.token_stream())

    def build_datasets(self, tokens: torch.Tensor) -> tuple[Dataset, Dataset]:
        raise NotImplementedError

    def split_point(self, count: int) -> int:
        """Index of the first validation example among ``count``."""
        val = max(1, round(count * self.val_fraction)) if self.val_fraction > 0 else 0
        return count - val

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def _loader(self, dataset: Any, shuffle: bool) -> DataLoader:
        trainer = self.trainer
        world, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        # Our own sampler with drop_last: Lightning's injected one pads by repeating samples across ranks.
        sampler = DistributedSampler(
            dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=self.seed, drop_last=True
        )
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler, drop_last=True)


class TensorExamples(Dataset):
    """Examples stored as rows of tensors; each item is a dict that also carries its ``sample_index``."""

    def __init__(self, **columns: torch.Tensor) -> None:
        self.columns = columns
        self.length = len(next(iter(columns.values())))

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"sample_index": index, **{name: column[index] for name, column in self.columns.items()}}
