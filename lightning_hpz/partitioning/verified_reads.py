"""DeepSpeed's checkpoint reads, each checked against the integrity manifest from the very bytes it loads.

The check before a load (``checkpointing/resume.py``) hashes the files, and DeepSpeed then opens them again by path: a
file replaced or rewritten in between, or a read that returns other bytes than the check saw (a network file
system's client cache), would load unverified. While DeepSpeed loads, its engine's ``checkpoint_engine`` (the object
every DeepSpeed checkpoint read goes through: ``DeepSpeedEngine._load_checkpoint``, ``_get_all_zero_checkpoints``,
the ZeRO-3 state-dict loader) is wrapped: each file it asks for is mapped once, hashed from the mapping, compared with
the manifest, and handed to ``torch.load`` as that same mapping. The pages are the page cache's: no second copy in
memory. Files the manifest does not list (a universal-format copy) pass through unchanged.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_hpz.checkpointing.errors import CheckpointIntegrityError
from lightning_hpz.checkpointing.manifest import buffer_digest, digest_problem

# DeepSpeed's plain torch.load engine: the one this wrapper reads for (the asynchronous writers are refused at setup)
WRAPPED_ENGINE = "TorchCheckpointEngine"


class VerifiedReads:
    """A checkpoint engine whose ``load`` verifies each manifest file it reads; everything else is the wrapped one."""

    def __init__(self, inner: Any, checkpoint_dir: Path, recorded: dict[str, Any]) -> None:
        self.inner = inner
        self.checkpoint_dir = Path(checkpoint_dir).resolve()
        self.entries: dict[str, dict[str, Any]] = recorded["files"]
        self.verified: list[str] = []  # names, in the order DeepSpeed read them

    def load(self, path: Any, map_location: Any = None) -> Any:
        expected = self.entries.get(self._name(path)) if self._name(path) else None
        if expected is None or expected["size"] == 0:
            return self.inner.load(path, map_location=map_location)
        with open(path, "rb") as stream, mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) as mapping:
            problem = digest_problem(path, expected, buffer_digest(mapping))
            if problem:
                raise CheckpointIntegrityError(
                    f"Checkpoint file changed between its verification and its load: {problem}. Another process may "
                    f"be writing {self.checkpoint_dir}, or its storage returns inconsistent data; load it again once "
                    "nothing else writes it, or resume from an earlier checkpoint."
                )
            self.verified.append(self._name(path) or str(path))
            return torch.load(mapping, map_location=map_location, weights_only=False)

    def _name(self, path: Any) -> Optional[str]:
        try:
            return str(Path(path).resolve().relative_to(self.checkpoint_dir))
        except ValueError:
            return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@contextlib.contextmanager
def verifying_reads(
    engine: Any, checkpoint_dir: Path, recorded: Optional[dict[str, Any]]
) -> Iterator[Optional[VerifiedReads]]:
    """While DeepSpeed loads ``checkpoint_dir`` into ``engine``, verify every file it reads; yields the wrapper (None
    without a manifest or for another checkpoint engine: nothing is checked then)."""
    inner = getattr(engine, "checkpoint_engine", None)
    if recorded is None or type(inner).__name__ != WRAPPED_ENGINE or not callable(getattr(inner, "load", None)):
        yield None
        return
    reads = VerifiedReads(inner, checkpoint_dir, recorded)
    engine.checkpoint_engine = reads
    try:
        yield reads
    finally:
        engine.checkpoint_engine = inner
