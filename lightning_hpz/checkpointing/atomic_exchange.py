"""Swap two paths in one step (Linux ``renameat2(..., RENAME_EXCHANGE)``), so that neither is ever missing.

Python has no binding for it; the C library's ``renameat2`` (glibc 2.28+) is called through ctypes. File systems that
cannot exchange (NFS, Lustre, some FUSE) answer EINVAL or ENOSYS: the caller then falls back to two renames.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from functools import cache
from pathlib import Path
from typing import Any, Optional

AT_FDCWD = -100
RENAME_EXCHANGE = 1 << 1


@cache
def _renameat2() -> Optional[Any]:
    if not hasattr(os, "sched_getaffinity"):  # not Linux
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        function = libc.renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def atomic_exchange(first: Path, second: Path) -> bool:
    """Swap ``first`` and ``second`` (both must exist) atomically; False when this system or file system cannot."""
    function = _renameat2()
    if function is None:
        return False
    result = function(AT_FDCWD, os.fsencode(first), AT_FDCWD, os.fsencode(second), RENAME_EXCHANGE)
    if result == 0:
        return True
    error = ctypes.get_errno()
    if error in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: this file system cannot exchange
        return False
    raise OSError(error, os.strerror(error), str(first), None, str(second))
