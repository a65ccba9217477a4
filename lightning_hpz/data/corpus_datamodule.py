"""Base of the data modules: open a prepared corpus (small sources prepared on the fly), split, serve per rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import lightning as L
from torch.utils.data import Dataset

from lightning_hpz import collectives
from lightning_hpz.data.corpus import DEFAULT_CORPUS
from lightning_hpz.data.packing import SequenceTooLongError
from lightning_hpz.data.prepared_shards import (
    PreparedShards,
    check_fits_tokenizer,
    is_prepared,
    is_unfinished,
    read_manifest,
)
from lightning_hpz.data.token_cache import cache_directory, prepare_into_cache
from lightning_hpz.data.tokenizers import Tokenizer, load_tokenizer
from lightning_hpz.exact_resume.resumable_batches import RankShare, ResumableBatches

DEFAULT_CACHE_DIR = ".cache/lightning_hpz/tokens"


class CorpusDataModule(L.LightningDataModule):
    """Serves fixed-length examples cut from a prepared (tokenized, memory-mapped) corpus.

    Subclasses say how the token stream becomes examples (:meth:`build_datasets`). Each rank reads only the examples
    of its own share; the training loader is resumable mid-epoch by position (its state is in Lightning's checkpoints).

    Args:
        source: a directory written by ``lightning-hpz prepare-data`` (read directly); or ``"default"`` (the embedded
            CPython help text), ``"default+stdlib"`` (plus the standard library's source), or a local .txt / .jsonl /
            .parquet file or datasets directory, prepared on first use into ``cache_dir`` by rank 0 (others wait).
        tokenizer: ``"byte"`` (default) or the local directory of a Hugging Face tokenizer; a prepared ``source`` must
            have been prepared with the same one.
        batch_size: examples per rank per step.
        val_fraction: share of the packed examples held out (the corpus's tail, so no text is in both splits).
        text_field: field (.jsonl) or column (.parquet, datasets) holding the text.
        cache_dir: where small sources are prepared, one directory per (source, tokenizer, options).
        seed: seed of the per-epoch shuffle (the epoch is added, so each epoch has its own, reproducible order).
        errors: what to do with bytes that are not UTF-8 in a .txt / .jsonl source: ``"strict"`` (refuse, naming the
            file and byte offset), ``"replace"`` or ``"ignore"``.
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
        errors: str = "strict",
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
        self.errors = errors
        self.tokenizer: Tokenizer = load_tokenizer(tokenizer)
        self.shards: Optional[PreparedShards] = None
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

    @property
    def sequence_tokens(self) -> int:
        """Tokens of the stream consumed by one example."""
        return self.sequence_length

    def prepared_directory(self) -> Path:
        if is_prepared(self.source):
            return Path(self.source)
        return cache_directory(self.source, self.tokenizer, self.text_field, self.errors, self.cache_dir)

    def prepare_data(self) -> None:
        if is_unfinished(self.source):
            read_manifest(self.source)  # raises: names the directory and the command that finishes it
        if not is_prepared(self.source):  # local rank 0 only (Lightning); a no-op once the cache holds this source
            prepare_into_cache(
                self.source, self.tokenizer_spec, self.tokenizer, self.text_field, self.errors, self.cache_dir
            )

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        if collectives.rank() == 0:
            self.prepare_data()  # a no-op when Lightning already called it; covers use without a Trainer
        collectives.barrier()  # nobody opens the shards before rank 0 has committed them
        self.shards = PreparedShards(self.prepared_directory())
        check_fits_tokenizer(self.shards, self.tokenizer)
        self.train_set, self.val_set = self.build_datasets(self.shards)
        self._check_one_global_batch()

    def build_datasets(self, shards: PreparedShards) -> tuple[Dataset, Dataset]:
        raise NotImplementedError

    def examples_in_stream(self) -> int:
        assert self.shards is not None
        count = len(self.shards) // self.sequence_tokens
        if count == 0:
            raise SequenceTooLongError(
                f"The corpus has {len(self.shards)} tokens, fewer than one sequence of {self.sequence_tokens}. Use a "
                "larger corpus or a shorter sequence_length."
            )
        return count

    def split_point(self, count: int) -> int:
        """Index of the first validation example among ``count``."""
        val = max(1, round(count * self.val_fraction)) if self.val_fraction > 0 else 0
        return count - val

    def _rank_and_world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is not None:
            return trainer.global_rank, trainer.world_size
        return collectives.rank(), collectives.world_size()

    def _check_one_global_batch(self) -> None:
        _, world = self._rank_and_world()
        assert self.train_set is not None and self.shards is not None
        if len(self.train_set) < world * self.batch_size:  # Lightning would end with "No training batches", exit 0
            raise SequenceTooLongError(
                f"The corpus {self.source!r} has {len(self.shards)} tokens: {len(self.train_set)} training sequences "
                f"of {self.sequence_tokens} tokens, fewer than one global batch of batch_size {self.batch_size} x "
                f"{world} ranks = {self.batch_size * world}. Use a larger corpus, a smaller batch_size or "
                "sequence_length, or fewer ranks."
            )

    def train_dataloader(self) -> ResumableBatches:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> ResumableBatches:
        return self._loader(self.val_set, shuffle=False)

    def _loader(self, dataset: Any, shuffle: bool) -> ResumableBatches:
        rank, world = self._rank_and_world()
        # Not a torch DataLoader, so Lightning leaves it as it is (it would otherwise inject a sampler that pads by
        # repeating examples); every rank gets the same number of whole batches.
        return ResumableBatches(dataset, RankShare(len(dataset), rank, world, self.seed, shuffle), self.batch_size)
