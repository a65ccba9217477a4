"""Exact mid-epoch resume for an ordinary DataLoader.

Lightning restarts an epoch from its first batch when it resumes from a checkpoint taken mid-epoch, unless the
dataloader is stateful, so the resumed run trains on other batches than the uninterrupted one. The sampler is
re-seeded per epoch (``set_epoch``), so the epoch's order is reproducible: starting the resumed epoch after the
batches the checkpointed run had already trained on makes the continuation exact.

- A map-style loader starts there by index: its batch sampler (which only yields indices) is advanced, and no skipped
  example is read or collated.
- A loader whose position can be asked for (a ``Stateful`` loader, or a ``Stateful`` ``IterableDataset`` read without
  workers) is put back at the position it reported after the last trained batch, each rank at its own
  (:mod:`stream_position`); nothing is read again.
- Any other loader over an ``IterableDataset`` has no indices to jump to: under ``exact_resume`` the resume is refused
  (``DataOrderError``, naming the fix); otherwise the skipped batches are read again and dropped (with a warning saying
  how many), which is exact when the stream repeats itself, as a seeded one does.
- With several training loaders, Lightning's default mode restarts a shorter loader whenever it runs out
  (``max_size_cycle``), so each loader resumes at the epoch's batch count modulo its own length.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any, Optional

from lightning.fabric.utilities.data import has_len
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader

from lightning_hpz.exact_resume.data_order import DataOrderError, order_record
from lightning_hpz.exact_resume.stream_position import (
    PositionRecord,
    own_position,
    position_source,
    reads_a_stream,
    unpositioned_reason,
)

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
    """Wraps a dataloader; its state is how many batches of the current epoch training has consumed, and, for a
    loader whose position can be asked for, where its stream stood after them on each rank.

    Args:
        loader: the dataloader to wrap (attribute access passes through, so Lightning still finds its sampler).
        batches_consumed: returns how many batches of the current epoch the training loop has finished.
        world_size: ranks sharing the epoch (each reads every ``world_size``-th example, as Lightning's distributed
            sampler deals them); a resume on another number of ranks starts at the same global sample position.
        rank: this process's rank among them (which of the saved stream positions is its own).
        exact: refuse a mid-epoch resume of a stream that cannot be positioned, instead of reading it again.
    """

    def __init__(
        self,
        loader: Any,
        batches_consumed: Callable[[], int],
        world_size: int = 1,
        rank: int = 0,
        exact: bool = False,
    ) -> None:
        self.loader = loader
        self._batches_consumed = batches_consumed
        self.world_size, self.rank, self.exact = world_size, rank, exact
        source = position_source(loader)
        self._positions = PositionRecord(source) if source is not None else None
        self._skip_next_epoch_start = 0
        self._resume_position: Optional[tuple[Any]] = None  # (the saved position,) until the next pass starts

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (during unpickling): do not recurse
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        start, self._skip_next_epoch_start = self._skip_next_epoch_start, 0
        resume, self._resume_position = self._resume_position, None
        if resume is not None:  # the source continues from its saved position: nothing is skipped here
            self._positions.source.load_state_dict(resume[0])
            iterator = iter(self.loader)
        else:
            iterator = self._batches_from(start)
        return iterator if self._positions is None else self._positions.follow(iterator, start)

    def _batches_from(self, start: int) -> Iterator[Any]:
        if start and _jumps_by_index(self.loader):
            return iter(_loader_from_batch(self.loader, start))
        iterator = iter(self.loader)
        for _ in range(start):
            next(iterator, None)
        return iterator

    def state_dict(self) -> dict[str, Any]:
        # the order record lets a resume check that its sampler repeats this run's order (exact_resume.data_order)
        consumed = int(self._batches_consumed())
        state = {"batches_consumed": consumed, "world_size": self.world_size, "order": order_record(self.loader)}
        if self._positions is not None:  # this rank's; the strategy gathers every rank's when it saves
            state["position"] = self._positions.after(self._in_this_pass(consumed))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        consumed = self._batches_at_this_world_size(int(state.get("batches_consumed", 0)), state.get("world_size"))
        # a checkpoint after an epoch's last batch resumes at the next epoch's start; a shorter loader that
        # Lightning restarted when it ran out resumes where its current round stands
        self._skip_next_epoch_start = consumed = self._in_this_pass(consumed)
        if not consumed:
            return
        usable, position = own_position(state, self.rank, self.world_size) if self._positions else (False, None)
        if usable and position is not None:
            self._resume_position = (position,)
        elif reads_a_stream(self.loader):
            self._read_stream_again(consumed)

    def _in_this_pass(self, consumed: int) -> int:
        return consumed % len(self.loader) if has_len(self.loader) else consumed

    def _read_stream_again(self, consumed: int) -> None:
        if self.exact:
            raise DataOrderError(
                f"Cannot resume exactly {consumed} batches into an epoch: {unpositioned_reason(self.loader)}. Or "
                "pass HpzStrategy(exact_resume=False) to read the stream again up to the position."
            )
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
