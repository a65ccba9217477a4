"""DeepSpeed's checkpoint writes, each checksummed from the bytes as they are written and made durable at once.

The commit's manifest vouches for every file of a checkpoint. Hashing a file after it is written reads it back, which
costs a second pass over every byte (and, from the page cache, vouches for what may not have reached the storage).
While DeepSpeed saves, its engine's ``checkpoint_engine`` (the object every shard write goes through:
``DeepSpeedEngine._save_checkpoint``, ``_save_zero_checkpoint``) is wrapped: ``torch.save`` writes into a stream
that feeds each chunk to blake2b on its way to the file, which is then ``fsync``ed and dropped from the page cache.
The digests are the writer's; files written otherwise (DeepSpeed's ``latest``) are left to the commit to read back.
A write that fails (a full disk or quota, which network file systems often report only at ``fsync``) is recorded,
not raised: raised on this rank alone, inside DeepSpeed's save, it would leave the other ranks waiting in DeepSpeed's
barrier until the process group times out. The commit raises it on every rank. The zip archive's inner folder is
named ``archive`` (torch's name when saving into a stream) rather than after the file; ``torch.load`` does not care.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_hpz.partitioning.checkpoint_engine_wrapper import CheckpointEngineWrapper, engine_wrapped


class _HashingStream:
    """A binary file that hashes what is written to it: the only method ``torch.save`` calls on a stream."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.digest = hashlib.blake2b(digest_size=16)
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.digest.update(view)
        self.size += len(view)
        return self.stream.write(view)

    def flush(self) -> None:
        self.stream.flush()


class HashedWrites(CheckpointEngineWrapper):
    """A checkpoint engine whose ``save`` hashes each file while writing it; everything else is the wrapped one's."""

    def __init__(self, inner: Any, checkpoint_dir: Path) -> None:
        super().__init__(inner, checkpoint_dir)
        self.digests: dict[str, dict[str, Any]] = {}  # by name relative to the checkpoint: {"size", "blake2b"}
        self.failures: list[str] = []  # writes that failed, for the commit to raise on every rank

    def save(self, state_dict: Any, path: Any) -> None:
        name = self.name_in_checkpoint(path)
        if name is None:
            return self.inner.save(state_dict, path)
        try:
            self.digests[name] = _write_hashed(state_dict, path, getattr(self.inner, "zipfile_serialization", True))
        except Exception as error:  # any failure: raised by the commit on every rank
            self.failures.append(f"writing {path}: {type(error).__name__}: {error}")
        return None


def _write_hashed(state_dict: Any, path: Any, new_format: bool) -> dict[str, Any]:
    with open(path, "wb") as file:
        stream = _HashingStream(file)
        torch.save(state_dict, stream, _use_new_zipfile_serialization=new_format)
        file.flush()
        os.fsync(file.fileno())  # durable before the commit relies on it
        if hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):  # a hint: a shard is not read again soon
                os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return {"size": stream.size, "blake2b": stream.digest.hexdigest()}


def hashing_writes(engine: Any, checkpoint_dir: Path) -> contextlib.AbstractContextManager[Optional[HashedWrites]]:
    """While DeepSpeed saves ``engine`` into ``checkpoint_dir``, hash every file it writes; yields the wrapper (None for
    another checkpoint engine: the commit then reads every file back)."""
    return engine_wrapped(engine, "save", lambda inner: HashedWrites(inner, checkpoint_dir))
