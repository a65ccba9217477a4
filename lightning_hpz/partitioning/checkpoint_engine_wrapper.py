"""A stand-in for DeepSpeed's checkpoint engine while one save or load runs: the single place both the hashed writes
(``hashed_writes.py``) and the verified reads (``verified_reads.py``) hook into DeepSpeed's checkpoint I/O.

Every file DeepSpeed's engine writes or reads for a checkpoint goes through ``engine.checkpoint_engine``. A wrapper
replaces it for the duration of the call, takes over the one method it is about, and hands every other attribute to
the wrapped engine. Only DeepSpeed's plain ``TorchCheckpointEngine`` is wrapped: the asynchronous writers are refused
at setup, and another engine (a user's) is left alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional, TypeVar

WRAPPED_ENGINE = "TorchCheckpointEngine"  # DeepSpeed's torch.save / torch.load engine


class CheckpointEngineWrapper:
    """Holds the wrapped engine; every attribute the subclass does not define is the wrapped engine's."""

    def __init__(self, inner: Any, checkpoint_dir: Path) -> None:
        self.inner = inner
        self.checkpoint_dir = Path(checkpoint_dir).resolve()

    def name_in_checkpoint(self, path: Any) -> Optional[str]:
        """``path`` relative to the checkpoint, or None for a file outside it."""
        try:
            return str(Path(path).resolve().relative_to(self.checkpoint_dir))
        except ValueError:
            return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


Wrapper = TypeVar("Wrapper", bound=CheckpointEngineWrapper)


@contextlib.contextmanager
def engine_wrapped(engine: Any, method: str, make: Callable[[Any], Wrapper]) -> Iterator[Optional[Wrapper]]:
    """While the block runs, ``engine.checkpoint_engine`` is ``make(inner)``; yields it (None, and nothing replaced,
    unless the engine is DeepSpeed's plain one with a callable ``method``)."""
    inner = getattr(engine, "checkpoint_engine", None)
    if type(inner).__name__ != WRAPPED_ENGINE or not callable(getattr(inner, method, None)):
        yield None
        return
    wrapper = make(inner)
    engine.checkpoint_engine = wrapper
    try:
        yield wrapper
    finally:
        engine.checkpoint_engine = inner
