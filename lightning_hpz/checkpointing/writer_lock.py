"""One training job writes a checkpoint folder: a second one is refused at its first save, naming the first.

Two jobs saving into one folder delete each other's staged copies (a save clears what it finds in staging), number
their preemption checkpoints from the same ``hpc_ckpt_<N>`` and retire each other's, and a manifest can then vouch for
a mix. Rank 0 claims the folder at its first save with ``.hpz-writer.json`` (job, host, process, time) and releases
it at teardown, or when the process exits (a Fabric script may never call teardown). A claim by the same job (a
requeued SLURM job, a restarted torchrun job) is taken over, as is one left on this host by a process that no longer
exists; any other is refused with what to do.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Optional

from lightning_hpz import collectives
from lightning_hpz.checkpointing.errors import CheckpointStorageError

LOCK_NAME = ".hpz-writer.json"
_claimed: dict[str, Path] = {}  # folder -> the lock this process holds there


def this_job() -> dict[str, Any]:
    """Who is writing: the scheduler's job id when there is one, and this process."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    # multi-node torchrun without --rdzv-id names every job "none": no identity to go by
    job = os.environ.get("SLURM_JOB_ID") or (run_id if run_id not in (None, "", "none") else None)
    if os.environ.get("SLURM_ARRAY_JOB_ID"):
        job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}"
    return {"job": job, "host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def _read(lock: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads(lock.read_text())
    except (OSError, ValueError):
        return None


def _same_writer(holder: dict[str, Any], me: dict[str, Any]) -> bool:
    if holder.get("job") and holder.get("job") == me["job"]:
        return True  # requeued or restarted: the same job
    return holder.get("host") == me["host"] and holder.get("pid") == me["pid"]


def _gone(holder: dict[str, Any], me: dict[str, Any]) -> bool:
    if holder.get("host") != me["host"]:
        return False  # cannot tell from here
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, KeyError, TypeError, ValueError):
        return False
    return False


def held_by_another_job(folder: Path) -> Optional[dict[str, Any]]:
    """The claim of another job that may still be writing ``folder`` (one that is not this job, nor gone), or None."""
    holder, me = _read(Path(folder) / LOCK_NAME), this_job()
    if holder is not None and not _same_writer(holder, me) and not _gone(holder, me):
        return holder
    return None


def claim(folder: Path) -> Path:
    """Claim ``folder`` for this job (rank 0 only); raises :class:`CheckpointStorageError` if another job holds it."""
    lock, me = Path(folder) / LOCK_NAME, this_job()
    holder = held_by_another_job(folder)
    if holder is not None:
        job = f"job {holder['job']}" if holder.get("job") else "another job"
        raise CheckpointStorageError(
            f"Checkpoint folder {folder} is being written by {job} (host {holder.get('host')}, process "
            f"{holder.get('pid')}, since {holder.get('since')}). Two jobs saving into one folder delete each other's "
            f"checkpoints. Give this run its own folder (ModelCheckpoint(dirpath=...) / default_root_dir), or, if that "
            f"job has ended, delete {lock}."
        )
    partial = lock.with_suffix(".partial")
    partial.write_text(json.dumps(me))
    os.replace(partial, lock)
    return lock


def release(lock: Path) -> None:
    """Remove the claim if it is still this process's."""
    holder = _read(lock)
    if holder is not None and holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid():
        with contextlib.suppress(OSError):
            lock.unlink()


def claim_for_this_job(folder: Path) -> None:
    """Collective, once per folder and process: rank 0 claims ``folder``; a refusal is raised on every rank alike."""
    key = str(Path(folder).resolve())
    if key in _claimed:
        return
    refusal, lock = None, None
    if collectives.rank() == 0:
        try:
            lock = claim(Path(folder))
        except CheckpointStorageError as error:
            refusal = str(error)
        except OSError as error:  # raised here alone, the other ranks would wait in the broadcast
            refusal = f"Cannot claim checkpoint folder {folder} for this job: {error}."
    refusal = collectives.broadcast_object(refusal)
    if refusal is not None:
        raise CheckpointStorageError(refusal)
    if not _claimed:
        atexit.register(release_all)  # a Fabric script may never call teardown
    _claimed[key] = lock or Path(folder) / LOCK_NAME


def release_all() -> None:
    """At teardown (or exit): give up every folder this process claimed."""
    atexit.unregister(release_all)
    while _claimed:
        release(_claimed.popitem()[1])
