"""Exact mid-epoch resume for an ordinary DataLoader.

Lightning restarts an epoch from its first batch when it resumes from a checkpoint taken mid-epoch, unless the
dataloader is stateful, so the resumed run trains on other batches than the uninterrupted one. The sampler is
re-seeded per epoch (``set_epoch``), so the epoch's order is reproducible: starting the resumed epoch after the
batches the checkpointed run had already trained on makes the continuation exact.

- A map-style loader starts there by index: its batch sampler (which only yields indices) is advanced, and no skipped
  example is read or collated.
- A loader over an ``IterableDataset`` has no indices to jump to: the skipped batches are read again and dropped
  (with a warning saying how many), which is exact when the stream repeats itself, as a seeded one does.
- With several training loaders, Lightning's default mode restarts a shorter loader whenever it runs out
  (``max_size_cycle``), so each loader resumes at the epoch's batch count modulo its own length.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

from lightning.fabric.utilities.data import has_len
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader

from lightning_hpz.exact_resume.data_order import order_record

# DataLoader settings a loader that starts mid-epoch must keep (the batch sampler it is given holds batch_size,
# drop_last, shuffling)
_KEPT = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context", "generator",
         "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order")  # fmt: skip


class _BatchesFrom:
    """A batch sampler's index lists from batch ``start`` on (the skipped ones are computed, not read)."""

    def __init__(self, batch_sampler: Any, start: int) -> None:
        self.batch_sampler, self.start = batch_sampler, start

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.batch_sampler), self.start, None)

    def __len__(self) -> int:
        return max(len(self.batch_sampler) - self.start, 0)


def _loader_from_batch(loader: DataLoader, start: int) -> DataLoader:
    kept = {name: getattr(loader, name) for name in _KEPT if hasattr(loader, name)}
    if not kept.get("num_workers"):
        kept.pop("prefetch_factor", None)  # DataLoader refuses it without workers
        kept.pop("persistent_workers", None)
    return DataLoader(loader.dataset, batch_sampler=_BatchesFrom(loader.batch_sampler, start), **kept)


def _jumps_by_index(loader: Any) -> bool:
    # a DataLoader subclass may iterate its own way: it is skipped by reading, as before
    return type(loader) is DataLoader and loader.batch_sampler is not None and has_len(loader.batch_sampler)


class ResumableLoader:
    """Wraps a dataloader; its state is how many batches of the current epoch training has consumed.

    Args:
        loader: the dataloader to wrap (attribute access passes through, so Lightning still finds its sampler).
        batches_consumed: returns how many batches of the current epoch the training loop has finished.
        world_size: ranks sharing the epoch (each reads every ``world_size``-th example, as Lightning's distributed
            sampler deals them); a resume on another number of ranks starts at the same global sample position.
    """

    def __init__(self, loader: Any, batches_consumed: Callable[[], int], world_size: int = 1) -> None:
        self.loader = loader
        self._batches_consumed = batches_consumed
        self.world_size = world_size
        self._skip_next_epoch_start = 0

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (during unpickling): do not recurse
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        skip, self._skip_next_epoch_start = self._skip_next_epoch_start, 0
        if skip and _jumps_by_index(self.loader):
            return iter(_loader_from_batch(self.loader, skip))
        iterator = iter(self.loader)
        for _ in range(skip):
            next(iterator, None)
        return iterator

    def state_dict(self) -> dict[str, Any]:
        # the order record lets a resume check that its sampler repeats this run's order (exact_resume.data_order)
        consumed = int(self._batches_consumed())
        return {"batches_consumed": consumed, "world_size": self.world_size, "order": order_record(self.loader)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        consumed = self._batches_at_this_world_size(int(state.get("batches_consumed", 0)), state.get("world_size"))
        if has_len(self.loader):
            # a checkpoint after an epoch's last batch resumes at the next epoch's start; a shorter loader that
            # Lightning restarted when it ran out resumes where its current round stands
            self._skip_next_epoch_start = consumed % len(self.loader)
            return
        self._skip_next_epoch_start = consumed
        if consumed:
            rank_zero_warn(
                f"Resuming an iterable training dataset: its first {consumed} batches of this epoch are read again and "
                "dropped (a stream has no index to start from). The continuation is exact only if the dataset yields "
                "the same sequence again, for example from a fixed seed per epoch."
            )

    def _batches_at_this_world_size(self, consumed: int, saved_world: Any) -> int:
        # `consumed` batches on each of `saved_world` ranks covered the epoch's first consumed x saved_world batches'
        # worth of examples (dealt round-robin); here they are that many divided by this run's ranks
        if saved_world in (None, self.world_size):
            return consumed
        examples_in_batches = consumed * int(saved_world)
        here, left_over = divmod(examples_in_batches, self.world_size)
        if left_over:
            rank_zero_warn(
                f"Resuming on {self.world_size} ranks after {consumed} batches on each of {saved_world}: the epoch "
                f"continues after {here} batches per rank, so {left_over} rank-batches' worth of examples are trained "
                "again."
            )
        return here
