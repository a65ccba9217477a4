"""DeepSpeed's checkpoint writes, each checksummed from the bytes as they are written and made durable at once.

The commit's manifest vouches for every file of a checkpoint. Hashing a file after it is written reads it back, which
costs a second pass over every byte (and, from the page cache, vouches for what may not have reached the storage).
While DeepSpeed saves, its engine's ``checkpoint_engine`` (the object every shard write goes through:
``DeepSpeedEngine._save_checkpoint``, ``_save_zero_checkpoint``) is wrapped: ``torch.save`` writes into a stream
that feeds each chunk to blake2b on its way to the file, which is then ``fsync``ed and dropped from the page cache.
The digests are the writer's; files written otherwise are left to the commit to read back. A write that fails (a
full disk or quota, which network file systems often report only at ``fsync``) is recorded, not raised: raised on
this rank alone, inside DeepSpeed's save, it would leave the other ranks waiting in DeepSpeed's barrier until the
process group times out. The commit raises it on every rank. For the same reason DeepSpeed is asked not to write
``latest`` (rank 0 alone writes it, just before that barrier, on the disk a failed shard may just have filled): the
commit writes it, with the tag DeepSpeed was given, where a failure reaches every rank. The zip archive's inner
folder is named ``archive`` (torch's name when saving into a stream) rather than after the file; ``torch.load`` does
not care.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
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
        self.latest_tag: Optional[str] = None  # the tag of a save whose `latest` the commit must write

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


@contextlib.contextmanager
def hashing_writes(engine: Any, checkpoint_dir: Path) -> Iterator[Optional[HashedWrites]]:
    """While DeepSpeed saves ``engine`` into ``checkpoint_dir``, hash every file it writes and leave ``latest`` to the
    commit; yields the wrapper (None for another checkpoint engine: the commit then reads every file back)."""
    with engine_wrapped(engine, "save", lambda inner: HashedWrites(inner, checkpoint_dir)) as writes:
        if writes is None or not callable(getattr(engine, "save_checkpoint", None)):
            yield writes
            return
        with _latest_left_to_the_commit(engine, writes):
            yield writes


@contextlib.contextmanager
def _latest_left_to_the_commit(engine: Any, writes: HashedWrites) -> Iterator[None]:
    # DeepSpeedEngine.save_checkpoint(save_dir, tag=None, client_state={}, save_latest=True, ...): a tagged save
    # (Lightning always passes tag="checkpoint") is made with save_latest=False, its tag kept for the commit
    save = engine.save_checkpoint

    def without_latest(save_dir: Any, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        if tag is not None and not args and kwargs.get("save_latest", True):
            writes.latest_tag = str(tag)
            kwargs["save_latest"] = False
        return save(save_dir, tag, *args, **kwargs)

    engine.save_checkpoint = without_latest  # shadows the method on this instance only
    try:
        yield
    finally:
        del engine.save_checkpoint
