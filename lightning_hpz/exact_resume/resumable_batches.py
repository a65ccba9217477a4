"""Batches of one rank's share of an epoch, resumable at any batch in O(1), with state Lightning checkpoints.

Lightning saves ``state_dict()`` of every training dataloader that has ``state_dict``/``load_state_dict`` (its
``_Stateful`` protocol, ``lightning.pytorch.loops.fit_loop._FitLoop.on_save_checkpoint``) and hands it back to
``load_state_dict`` before the resumed epoch starts. A loader with a length is not prefetched by Lightning
(``_PrefetchDataFetcher.__iter__``), so the batches handed out equal the batches trained on when a checkpoint is taken.
Resuming computes the next batch's indices from its position: nothing before it is read or collated again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
from torch.utils.data import Dataset, default_collate

from lightning_hpz.exact_resume.epoch_permutation import EpochPermutation


class RankShare:
    """Rank ``rank``'s examples of each epoch: positions ``rank, rank + world, ...`` of the epoch's shuffled order.

    Like ``DistributedSampler(drop_last=True)``: every rank gets ``size // world`` examples and no example is seen
    twice in an epoch. Lightning calls :meth:`set_epoch` at each epoch start (it looks for ``loader.sampler``).
    """

    def __init__(self, size: int, rank: int, world: int, seed: int, shuffle: bool) -> None:
        self.size, self.rank, self.world, self.seed, self.shuffle = size, rank, world, seed, shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size // self.world

    def indices(self, start: int, stop: int) -> np.ndarray:
        """Dataset indices of this rank's examples ``start`` to ``stop`` in the current epoch."""
        positions = np.arange(start, stop, dtype=np.int64) * self.world + self.rank
        return EpochPermutation(self.size, self.seed, self.epoch, self.shuffle).order(positions)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices(0, len(self)).tolist())


class BatchShape(NamedTuple):
    """How :class:`ResumableBatches` cuts batches, shaped like a DataLoader's ``batch_sampler`` for Lightning."""

    sampler: RankShare
    batch_size: int


class ResumableBatches:
    """Fixed-size batches (last partial one dropped) of ``dataset`` in ``sampler``'s order; state = position.

    Args:
        dataset: a map-style dataset.
        sampler: which examples this rank reads, in which order.
        batch_size: examples per batch.
        collate_fn: joins a list of examples into a batch (default: PyTorch's).
    """

    def __init__(
        self, dataset: Dataset, sampler: RankShare, batch_size: int, collate_fn: Callable[[list], Any] = default_collate
    ) -> None:
        self.dataset, self.sampler, self.batch_size, self.collate_fn = dataset, sampler, batch_size, collate_fn
        self.batches_consumed = 0  # of the current epoch
        self._resume_at = 0

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size

    @property
    def batch_sampler(self) -> BatchShape:
        # Lightning reads `loader.batch_sampler.sampler` (`_is_dataloader_shuffled`, evaluation loaders) and
        # `.batch_size` (DeepSpeedStrategy._auto_select_batch_size): what a DataLoader's batch sampler would answer.
        return BatchShape(self.sampler, self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        start, self._resume_at = self._resume_at, 0
        self.batches_consumed = start
        for batch in range(start, len(self)):
            indices = self.sampler.indices(batch * self.batch_size, (batch + 1) * self.batch_size)
            examples = [self.dataset[int(index)] for index in indices]
            self.batches_consumed = batch + 1
            yield self.collate_fn(examples)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.sampler.epoch, "batches_consumed": self.batches_consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.set_epoch(int(state["epoch"]))
        consumed = int(state["batches_consumed"])
        # A checkpoint taken after the epoch's last batch resumes at the start of the next epoch.
        self._resume_at = consumed if consumed < len(self) else 0
