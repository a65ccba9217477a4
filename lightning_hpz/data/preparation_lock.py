"""One preparer at a time per prepared directory, across processes, jobs and nodes that share a file system.

Two nodes training on the same small file both prepare it on the fly (Lightning calls ``prepare_data`` on each node's
local rank 0) into the same cache directory, and two jobs may run ``prepare-data`` on the same ``--out``. An exclusive
``flock`` on ``DIR/.prepare.lock`` serializes them: the second waits, then finds the finished preparation and does
nothing. The kernel (on NFS, the lock manager) releases the lock when its holder exits or is killed, so a crashed
preparer never leaves a lock that others wait on forever; the next holder clears what it left half-written.

The lock file is never deleted: deleting it would let a third process lock a new file of the same name while a second
still holds the old one.
"""

from __future__ import annotations

import errno
import fcntl
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_FILE = ".prepare.lock"


class PreparationLockError(OSError):
    """The file system refuses the lock that keeps two preparations of one directory apart."""


@contextmanager
def exclusive_preparation(directory: Path, announce_wait: bool = True) -> Iterator[None]:
    """Hold the preparation lock of ``directory`` (created if missing) for the duration of the block."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    with path.open("a") as file:
        if not _try_lock(file, path, fcntl.LOCK_EX | fcntl.LOCK_NB):
            if announce_wait:  # a wait of minutes should not look like a hang
                print(f"{directory} is being prepared by another process (lock {path}); waiting.", file=sys.stderr)
            _try_lock(file, path, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


def _try_lock(file: object, path: Path, operation: int) -> bool:
    """Lock, or return False if another process holds the lock and ``operation`` does not wait."""
    try:
        fcntl.flock(file, operation)
    except BlockingIOError:
        return False
    except OSError as err:
        if err.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            raise PreparationLockError(
                err.errno,
                f"Cannot lock {path} ({err.strerror}): this file system does not support flock, which keeps two "
                "preparations of one directory apart. Mount it with locking (e.g. Lustre `-o flock`), point "
                "cache_dir / --out at a local or lock-capable file system, or run `lightning-hpz prepare-data` "
                "once before training and pass its --out directory as the source.",
            ) from err
        raise
    return True
