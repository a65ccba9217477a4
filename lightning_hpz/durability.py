"""Make written bytes durable before anything relies on them: file and directory ``fsync``.

A file is on the storage only after ``fsync``; a new directory entry (a file created, a directory renamed) only after
an ``fsync`` of the directory holding it. Without them a power loss or a file-server failure can leave what a manifest
calls complete (a prepared corpus, a committed checkpoint) half on disk. :func:`persist_file` also drops the file from
the page cache (``POSIX_FADV_DONTNEED``), so that a checksum taken next reads what the storage holds, not what this
process wrote into memory. Used by the checkpoint commit and by the corpus shard writer.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def persist_file(path: Path) -> None:
    """``fsync`` one file and drop its clean pages, so that the next read comes from the storage."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(descriptor)


def persist_files(root: Path, names: Iterable[str]) -> None:
    for name in names:
        persist_file(root / name)


def persist_directory(path: Path) -> None:
    """``fsync`` a directory: the entries created, renamed or removed in it are on the storage afterwards."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def persist_tree_directories(root: Path) -> None:
    """Every directory under ``root`` and ``root`` itself, the deepest first."""
    for directory, _, _ in sorted(os.walk(root), key=lambda entry: -entry[0].count(os.sep)):
        persist_directory(Path(directory))
