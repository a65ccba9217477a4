"""DeepSpeed's checkpoint reads, each checked against the integrity manifest from the very bytes it loads.

A check that hashed a file by path before DeepSpeed opened it again would let a file replaced or rewritten in between,
or a read that returns other bytes than the check saw (a network file system's client cache), load unverified. While
DeepSpeed loads, its engine's ``checkpoint_engine`` (the object every DeepSpeed checkpoint read goes through:
``DeepSpeedEngine._load_checkpoint``, ``_get_all_zero_checkpoints``, the ZeRO-3 state-dict loader) is wrapped: each
file it asks for is mapped once, hashed from the mapping, compared with the manifest, and handed to ``torch.load`` as
that same mapping. The files a rank is known to read (its own shards, ``checkpointing/resume.py``) are mapped and
hashed before the load, so that damage is refused on every rank alike, and passed in already checked: each byte is
read from the storage once. The pages are the page cache's: no second copy in memory. Files the manifest does not
list (a universal-format copy) pass through unchanged. What a file must hash to, and the error when it does not, are
the caller's (``checkpointing/resume.py``): this module only maps and reads.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_hpz.partitioning.checkpoint_engine_wrapper import CheckpointEngineWrapper, engine_wrapped

# check(name, mapping): raises unless the mapped bytes of ``name`` (relative to the checkpoint) are the recorded ones
Check = Callable[[str, Any], None]
# size_of(name): the recorded size of ``name`` (relative to the checkpoint), None for a file the manifest does not list
SizeOf = Callable[[str], Optional[int]]


class VerifiedReads(CheckpointEngineWrapper):
    """A checkpoint engine whose ``load`` checks each listed file it reads; everything else is the wrapped one's."""

    def __init__(
        self,
        inner: Any,
        checkpoint_dir: Path,
        size_of: SizeOf,
        check: Check,
        verified: Optional[dict[str, Any]] = None,
    ) -> None:
        super().__init__(inner, checkpoint_dir)
        self.size_of = size_of
        self.check = check
        self.mapped = verified or {}  # files mapped and checked before the load, by name: read from that very mapping
        self.verified: list[str] = []  # names, in the order DeepSpeed read them

    def load(self, path: Any, map_location: Any = None) -> Any:
        name = self.name_in_checkpoint(path)
        if name in self.mapped:
            mapping = self.mapped[name]
            mapping.seek(0)
            self.verified.append(name)
            return torch.load(mapping, map_location=map_location, weights_only=False)
        if name is None or not self.size_of(name):  # not listed, or empty (nothing to map)
            return self.inner.load(path, map_location=map_location)
        with open(path, "rb") as stream, mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) as mapping:
            self.check(name, mapping)
            self.verified.append(name)
            return torch.load(mapping, map_location=map_location, weights_only=False)


@contextlib.contextmanager
def verifying_reads(
    engine: Any,
    checkpoint_dir: Path,
    size_of: Optional[SizeOf],
    check: Check,
    verified: Optional[dict[str, Any]] = None,
) -> Iterator[Optional[VerifiedReads]]:
    """While DeepSpeed loads ``checkpoint_dir`` into ``engine``, verify every file it reads; yields the wrapper (None
    without a manifest or for another checkpoint engine: nothing is checked then). ``verified``: mappings of files
    checked already (by name), which DeepSpeed then reads without a second pass over the storage."""
    if size_of is None:
        yield None
        return
    with engine_wrapped(
        engine, "load", lambda inner: VerifiedReads(inner, checkpoint_dir, size_of, check, verified)
    ) as reads:
        yield reads
