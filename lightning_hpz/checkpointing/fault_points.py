"""Named points in the checkpoint commit where a test can kill the process, to prove every instant is recoverable.

``LIGHTNING_HPZ_FAULT_POINT=<name>`` makes the process kill itself with SIGKILL (no cleanup, no ``finally``: what a
node failure or the scheduler's kill does) when it reaches that point. Unset, a point costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

FAULT_POINT_ENV_VAR = "LIGHTNING_HPZ_FAULT_POINT"

# in the order a commit reaches them
COMMIT_POINTS = (
    "commit:manifest_written",  # the staged copy is complete, nothing moved yet
    "commit:old_moved_aside",  # two-rename commit only: no checkpoint at the path
    "commit:new_in_place",  # the new copy at the path, the old one not yet deleted
)


def fault_point(name: str) -> None:
    if os.environ.get(FAULT_POINT_ENV_VAR) == name:
        os.kill(os.getpid(), signal.SIGKILL)
