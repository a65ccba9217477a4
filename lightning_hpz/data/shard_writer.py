"""Write a token stream into shards that are either complete or absent, never half-written under a valid name.

Each shard is written under a temporary name, flushed to disk (fsync) and only then renamed to ``shard-NNNNN.bin``
(an atomic step on POSIX file systems); the index and the manifest follow the same path, the manifest last. A run
killed at any moment leaves at most ``*.tmp`` files and shards with no manifest, which readers refuse and the next
run deletes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import BinaryIO

import numpy as np

from lightning_hpz import durability
from lightning_hpz.data.prepared_shards import INDEX, MANIFEST, Manifest

DEFAULT_SHARD_TOKENS = 1 << 28  # 512 MiB of uint16: few files for a large corpus, small enough to copy around


def write_atomically(path: Path, data: bytes) -> None:
    partial = path.with_name(path.name + ".tmp")
    with partial.open("wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    partial.replace(path)


def clear_preparation(directory: Path) -> None:
    """Remove the manifest first (the directory stops reading as valid), then every shard and leftover."""
    (directory / MANIFEST).unlink(missing_ok=True)
    ours = [
        directory / INDEX,
        directory / f"{INDEX}.tmp",
        directory / f"{MANIFEST}.tmp",
        *directory.glob("shard-*.bin*"),
    ]
    for path in ours:  # only files this module writes: --out may be a directory holding other things
        path.unlink(missing_ok=True)


class ShardWriter:
    """Appends token arrays to rolling shards of at most ``shard_tokens`` tokens of ``dtype``."""

    def __init__(self, directory: Path, dtype: str, shard_tokens: int = DEFAULT_SHARD_TOKENS) -> None:
        if shard_tokens < 1:
            raise ValueError(f"shard_tokens={shard_tokens} must be at least 1.")
        self.directory = directory
        self.dtype = np.dtype(dtype)
        self.shard_tokens = shard_tokens
        self.shards: list[dict[str, int | str]] = []
        self._file: BinaryIO | None = None
        self._in_shard = 0

    def append(self, tokens: np.ndarray) -> None:
        tokens = np.ascontiguousarray(tokens, dtype=self.dtype)  # a copy only if the dtype or layout differs
        while tokens.size:
            if self._file is None:
                self._open()
            room = self.shard_tokens - self._in_shard
            assert self._file is not None
            self._file.write(memoryview(tokens[:room]))  # the array's own bytes, no copy
            self._in_shard += min(room, tokens.size)
            tokens = tokens[room:]
            if self._in_shard == self.shard_tokens:
                self._close()

    def finish(self, manifest: Manifest) -> None:
        """Commit the last shard, then the index, then the manifest: only now does the directory read as prepared."""
        if self._file is not None:
            self._close()
        write_atomically(self.directory / INDEX, json.dumps({"shards": self.shards}, indent=1).encode())
        write_atomically(self.directory / MANIFEST, manifest.to_json().encode())
        durability.persist_directory(self.directory)  # the renames reach the disk with the directory entry

    def abandon(self) -> None:
        """Close an unfinished shard without committing it (its ``.tmp`` file is left for removal)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def _name(self) -> str:
        return f"shard-{len(self.shards):05d}.bin"

    def _open(self) -> None:
        self._file = (self.directory / (self._name() + ".tmp")).open("wb")
        self._in_shard = 0

    def _close(self) -> None:
        assert self._file is not None
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        name = self._name()
        (self.directory / (name + ".tmp")).replace(self.directory / name)
        self.shards.append({"file": name, "tokens": self._in_shard})
        self._file = None
