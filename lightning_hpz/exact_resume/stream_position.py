"""The position of a training stream that can report it (``Stateful``), taken after each trained batch, per rank.

An ``IterableDataset`` has no index to jump to; one that implements ``state_dict()``/``load_state_dict()``
(:class:`torch.distributed.checkpoint.stateful.Stateful`, what torchdata's ``StatefulDataLoader`` and Lightning's
``_Stateful`` check ask for) can say where it stands and continue from there. Three things stand between that and an
exact resume under Lightning and DeepSpeed:

- Lightning prefetches one batch of a loader without a length (``_PrefetchDataFetcher.__iter__``): when a checkpoint
  is taken the stream already stands one batch past the last trained one. The position is therefore recorded after
  every batch the loader hands out, and the checkpoint takes the one after the last trained batch.
- Each rank reads its own share of the stream, so each has its own position. At ZeRO 3 every rank writes and reads
  its own loop state (``zero_pp_rank_<r>_mp_rank_00_model_states.pt``); at ZeRO 1 and 2 DeepSpeed keeps rank 0's
  alone (``mp_rank_00_model_states.pt``), which every rank reads. So each rank's state keeps its own position, marked
  with its rank, and rank 0's also carries every rank's, gathered once to rank 0 (:func:`keep_rank_positions`): a
  save costs each rank one position and rank 0 the N of them, instead of N positions in each of N files.
- With worker processes the dataset object that iterates lives in the workers: the copy in the main process never
  moves. Its position is then only known to a loader that collects it from the workers, such as torchdata's
  ``StatefulDataLoader`` (itself ``Stateful``, so its own state is the position).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any, Optional

from torch.utils.data import IterableDataset

from lightning_hpz.lightning_internals import Stateful

# Positions kept per pass: Lightning prefetches one batch, so the one wanted is at most one behind the newest.
_KEPT_POSITIONS = 4


def position_source(loader: Any) -> Optional[Any]:
    """What reports the stream's position: the loader when it is ``Stateful`` (it positions itself), else its
    ``IterableDataset`` when that is ``Stateful`` and iterated in this process (no workers); None when nothing can.
    (A map-style dataset's position is its sampler's, whatever state the dataset keeps.)"""
    if isinstance(loader, Stateful):
        return loader
    if reads_a_stream(loader) and isinstance(loader.dataset, Stateful) and not getattr(loader, "num_workers", 0):
        return loader.dataset
    return None


def reads_a_stream(loader: Any) -> bool:
    """Whether the loader reads an ``IterableDataset`` (no index to start from)."""
    return isinstance(getattr(loader, "dataset", None), IterableDataset)


def unpositioned_reason(loader: Any) -> str:
    """Why a stream cannot be put back at its position, and what would let it."""
    dataset = getattr(loader, "dataset", None)
    name = type(dataset).__name__
    if position_source(loader) is not None:
        return (
            f"the checkpoint holds no position of the training stream ({name}) for this rank: it was written on "
            "another number of ranks, or before stream positions were saved. Resume from a checkpoint this version "
            "wrote on as many ranks"
        )
    if isinstance(dataset, Stateful):
        return (
            f"the training IterableDataset {name} is Stateful, but it is read by {loader.num_workers} worker "
            "processes, whose copies move while this process's copy does not. Read it with torchdata's "
            "StatefulDataLoader (it collects the position from the workers) or with num_workers=0"
        )
    return (
        f"the training IterableDataset {name} cannot be positioned (it has no state_dict/load_state_dict), so the "
        "resumed epoch would read the stream again from its start and drop the batches already trained, which is "
        "exact only if the stream repeats itself. Implement state_dict() (the position after the examples it "
        "yielded) and load_state_dict() (continue from there at the next iter()), the protocol of "
        "torch.distributed.checkpoint.stateful.Stateful"
    )


class PositionRecord:
    """The source's state after each batch of the current pass, keyed by how many batches the pass has handed out."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self._after: dict[int, Any] = {}

    def follow(self, iterator: Iterator[Any], start: int) -> Iterator[Any]:
        """Yield ``iterator``'s batches, recording the position after each; ``start`` batches precede the first."""
        self._after = {}
        for count, batch in enumerate(iterator, start + 1):
            self._after[count] = copy.deepcopy(self.source.state_dict())  # a snapshot: the source keeps moving
            self._after.pop(count - _KEPT_POSITIONS, None)
            yield batch

    def after(self, batches: int) -> Optional[Any]:
        """The position after ``batches`` batches of the pass, if recorded (none before the first)."""
        return self._after.get(batches)


def keep_rank_positions(checkpoint: dict[str, Any], rank: int, gather_to_rank_zero: Callable[[Any], list[Any]]) -> None:
    """Mark each training loader's own ``position`` with ``rank`` (``position_rank``) and, on rank 0, add every rank's
    (``positions``, in rank order), gathered by ``gather_to_rank_zero`` (None on the other ranks).

    Called on every rank while the checkpoint is saved; every rank has the same loaders, so all gather alike.
    """
    fit_state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
    states = [state for state in fit_state.get("combined_loader") or [] if isinstance(state, dict)]
    positioned = [state for state in states if "position" in state]
    if not positioned:
        return
    by_rank = gather_to_rank_zero([state["position"] for state in positioned])  # [rank][loader] on rank 0
    for index, state in enumerate(positioned):
        state["position_rank"] = rank
        if by_rank is not None:
            state["positions"] = [rank_positions[index] for rank_positions in by_rank]


def own_position(state: dict[str, Any], rank: int, world_size: int) -> tuple[bool, Optional[Any]]:
    """(whether this run can use the saved positions, this rank's position) from a loader's saved state: rank 0's
    vector of every rank's, else the rank's own (its own file, at ZeRO 3), when saved on as many ranks."""
    if "positions" in state:
        positions = state["positions"]
        return (True, positions[rank]) if len(positions) == world_size else (False, None)
    if "position_rank" in state:
        own = state["position_rank"] == rank and state.get("world_size") == world_size
        return (True, state["position"]) if own else (False, None)
    return ("position" in state, state.get("position"))  # saved without the gather: one process
