"""Named points in the checkpoint commit and the universal conversion where a test can kill the process, to prove
every instant is recoverable.

``LIGHTNING_HPZ_FAULT_POINT=<name>`` makes the process kill itself with SIGKILL (no cleanup, no ``finally``: what a
node failure or the scheduler's kill does) when it reaches that point. ``LIGHTNING_HPZ_FAULT_AT=<n>`` waits for the
n-th time the point is reached (a save every step: kill the n-th commit), and ``LIGHTNING_HPZ_FAULT_SCOPE=job`` kills
the whole process group instead (every rank of a job started in its own session, as a scheduler ends a job). Unset,
a point costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

FAULT_POINT_ENV_VAR = "LIGHTNING_HPZ_FAULT_POINT"
FAULT_AT_ENV_VAR = "LIGHTNING_HPZ_FAULT_AT"
FAULT_SCOPE_ENV_VAR = "LIGHTNING_HPZ_FAULT_SCOPE"

# in the order a commit reaches them
COMMIT_POINTS = (
    "commit:manifest_written",  # the staged copy is complete, nothing moved yet
    "commit:old_moved_aside",  # two-rename commit only: no checkpoint at the path
    "commit:new_in_place",  # the new copy at the path, the old one not yet deleted
)
# a unit of the universal-format conversion (a shard extracted, a parameter merged) written, not yet recorded as done
CONVERSION_ITEM_WRITTEN = "universal:item_written"

_reached: Counter[str] = Counter()


def fault_point(name: str) -> None:
    if os.environ.get(FAULT_POINT_ENV_VAR) != name:
        return
    _reached[name] += 1
    if _reached[name] < int(os.environ.get(FAULT_AT_ENV_VAR, "1")):
        return
    if os.environ.get(FAULT_SCOPE_ENV_VAR) == "job":
        os.killpg(os.getpgid(0), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
