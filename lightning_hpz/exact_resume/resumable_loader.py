"""Exact mid-epoch resume for an ordinary DataLoader.

Lightning restarts an epoch from its first batch when it resumes from a checkpoint taken mid-epoch, unless the
dataloader is stateful, so the resumed run trains on other batches than the uninterrupted one. The sampler is
re-seeded per epoch (``set_epoch``), so the epoch's order is reproducible: skipping the batches the checkpointed run
had already trained on makes the continuation exact.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from lightning_hpz.exact_resume.data_order import order_record


class ResumableLoader:
    """Wraps a dataloader; its state is how many batches of the current epoch training has consumed.

    Args:
        loader: the dataloader to wrap (attribute access passes through, so Lightning still finds its sampler).
        batches_consumed: returns how many batches of the current epoch the training loop has finished.
    """

    def __init__(self, loader: Any, batches_consumed: Callable[[], int]) -> None:
        self.loader = loader
        self._batches_consumed = batches_consumed
        self._skip_next_epoch_start = 0

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (during unpickling): do not recurse
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        skip, self._skip_next_epoch_start = self._skip_next_epoch_start, 0
        iterator = iter(self.loader)
        for _ in range(skip):
            next(iterator, None)
        return iterator

    def state_dict(self) -> dict[str, Any]:
        # the order record lets a resume check that its sampler repeats this run's order (exact_resume.data_order)
        return {"batches_consumed": int(self._batches_consumed()), "order": order_record(self.loader)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        consumed = int(state.get("batches_consumed", 0))
        # A checkpoint taken after an epoch's last batch resumes at the start of the next epoch.
        self._skip_next_epoch_start = consumed if consumed < len(self.loader) else 0
