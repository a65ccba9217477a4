"""Ranks started as a child command in a session of their own: their environment, the records they write, and
ending every process of the command, whatever state it is in.

``lightning-hpz bench`` starts a torchrun agent per testbed node and ``lightning-hpz study`` one command per cell;
both give each rank a spec file, collect the ``rank<r>.json`` each rank writes, and must leave nothing running when
a run fails or times out. What differs (two agents on two network namespaces against one command that may be
``srun``; a bench's link counters against a study's out-of-memory verdict) stays in ``bench/launch.py`` and
``study/cell_runner.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# What another launcher left in this process's environment: a child must rendezvous on its own.
_LAUNCHER_PREFIXES = ("MASTER_", "TORCHELASTIC_")
_RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def child_environment(base: Mapping[str, str] = os.environ) -> dict[str, str]:
    """``base`` without another launcher's rendezvous and rank variables, with unbuffered Python output."""
    env = {key: value for key, value in base.items() if not key.startswith(_LAUNCHER_PREFIXES)}
    for key in _RANK_VARIABLES:
        env.pop(key, None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def clear_rank_records(folder: Path) -> None:
    """Create ``folder`` and remove the records of an earlier run from it."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("rank*.json"):
        stale.unlink()


def read_rank_records(folder: Path) -> list[dict[str, Any]]:
    """Every ``rank<r>.json`` in ``folder``, ordered by rank (error records, ``rank<r>.error.json``, left out)."""
    records = (json.loads(path.read_text()) for path in folder.glob("rank*[0-9].json"))
    return sorted(records, key=lambda record: record["rank"])


def end_process_group(process: subprocess.Popen, grace_s: float = 60.0) -> None:
    """End every process of the cell's group: the command and any rank it started.

    After a clean exit of the command the other ranks may still be writing their records: they get ``grace_s``.
    """
    descendants = _descendants(process.pid)  # torchrun starts each rank in a process group of its own
    if process.poll() is None:
        _signal_group(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10)
    for pid in descendants:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + (grace_s if process.poll() == 0 else 10.0)
    while _group_alive(process.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    _signal_group(process.pid, signal.SIGKILL)
    if process.poll() is None:
        process.wait(timeout=10)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc; none elsewhere)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def _group_alive(group: int) -> bool:
    """Whether a process of ``group`` still runs (zombies, which no reaper may collect here, do not count)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(group, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
            if int(fields[2]) == group and fields[0] != "Z":
                return True
    return False


def _signal_group(group: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, sig)
