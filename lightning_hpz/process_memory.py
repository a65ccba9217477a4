"""This process's peak resident memory, in bytes on every platform (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""

from __future__ import annotations

import resource
import sys


def max_rss_bytes() -> int:
    """The resident set's high-water mark since the process started."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
