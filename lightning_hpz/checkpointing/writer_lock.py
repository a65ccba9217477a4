"""One training job writes a checkpoint folder: a second one is refused at its first save, naming the first.

Two jobs saving into one folder delete each other's staged copies (a save clears what it finds in staging), number
their preemption checkpoints from the same ``hpc_ckpt_<N>`` and retire each other's, and a manifest can then vouch for
a mix. Rank 0 claims the folder at its first save with ``.hpz-writer.json`` (job, host, process, a random token, and a
heartbeat it refreshes while the process lives) and releases it at teardown, or when the process exits (a Fabric
script may never call teardown).

The claim is created exclusively (a hard link of a complete file, which fails if the lock exists), so two jobs
starting at once cannot both create it; taking over a lock that may be replaced is confirmed by reading it back, and
every later save checks the token again before it touches the folder. A claim by the same job (a requeued SLURM job,
a restarted torchrun job) is taken over, as is one left by a process that no longer exists, or one whose heartbeat
stopped for longer than the lease (a job killed on another node: without the lease its folder stayed locked until
someone deleted the file by hand, and its interrupted commits unrepaired). Any other claim is refused with what to do.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from lightning_hpz import collectives
from lightning_hpz.checkpointing.errors import CheckpointStorageError

LOCK_NAME = ".hpz-writer.json"
LEASE_ENV_VAR = "LIGHTNING_HPZ_WRITER_LEASE_S"
DEFAULT_LEASE_S = 300.0  # a claim whose heartbeat is older than this is a dead job's
_claimed: dict[str, Path] = {}  # folder -> the lock this process holds there
_tokens: dict[int, str] = {}  # process id -> the token of its claims
_heartbeat: Optional[threading.Event] = None  # set to stop the heartbeat thread


def _token() -> str:
    """This process's token: drawn per process id, so that ranks forked from one pre-imported parent differ."""
    return _tokens.setdefault(os.getpid(), uuid.uuid4().hex)


def lease_seconds() -> float:
    return float(os.environ.get(LEASE_ENV_VAR, DEFAULT_LEASE_S))


def this_job() -> dict[str, Any]:
    """Who is writing: the scheduler's job id when there is one, and this process."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    # multi-node torchrun without --rdzv-id names every job "none": no identity to go by
    job = os.environ.get("SLURM_JOB_ID") or (run_id if run_id not in (None, "", "none") else None)
    if os.environ.get("SLURM_ARRAY_JOB_ID"):
        job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}"
    now = time.time()
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
    host, pid = socket.gethostname(), os.getpid()
    return {"job": job, "host": host, "pid": pid, "since": since, "beat": now, "token": _token()}


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
    """The holder no longer writes: its process is gone (this host), or its heartbeat stopped (any host)."""
    beat = holder.get("beat")
    if not isinstance(beat, (int, float)) or time.time() - beat > lease_seconds():
        return True  # no heartbeat for a lease (or a claim from before heartbeats): its job is dead
    if holder.get("host") != me["host"]:
        return False  # alive by its heartbeat
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


def _refusal(folder: Path, holder: dict[str, Any]) -> CheckpointStorageError:
    job = f"job {holder['job']}" if holder.get("job") else "another job"
    return CheckpointStorageError(
        f"Checkpoint folder {folder} is being written by {job} (host {holder.get('host')}, process "
        f"{holder.get('pid')}, since {holder.get('since')}). Two jobs saving into one folder delete each other's "
        f"checkpoints. Give this run its own folder (ModelCheckpoint(dirpath=...) / default_root_dir), or, if that "
        f"job has ended, delete {Path(folder) / LOCK_NAME} (a dead job's claim also expires {lease_seconds():.0f} s "
        f"after its last heartbeat)."
    )


def _write_partial(lock: Path, record: dict[str, Any]) -> Path:
    partial = lock.with_name(f"{lock.name}.{uuid.uuid4().hex}.partial")  # one per writer: two never share it
    partial.write_text(json.dumps(record))
    return partial


def _create_exclusively(lock: Path, record: dict[str, Any]) -> bool:
    """Create ``lock`` holding ``record`` unless it exists; complete or absent at every instant."""
    partial = _write_partial(lock, record)
    try:
        os.link(partial, lock)  # fails if the lock exists: only one of two claimers creates it
        return True
    except FileExistsError:
        return False
    except OSError:  # a file system without hard links: an exclusive create, written after
        try:
            with open(lock, "x") as stream:
                stream.write(json.dumps(record))
            return True
        except FileExistsError:
            return False
    finally:
        with contextlib.suppress(OSError):
            partial.unlink()


def claim(folder: Path) -> Path:
    """Claim ``folder`` for this job (rank 0 only); raises :class:`CheckpointStorageError` if another job holds it."""
    lock, me = Path(folder) / LOCK_NAME, this_job()
    if not _create_exclusively(lock, me):
        holder = _read(lock)
        if holder is not None and not _same_writer(holder, me) and not _gone(holder, me):
            raise _refusal(folder, holder)
        os.replace(_write_partial(lock, me), lock)  # a claim that is this job's, or a dead one's
        holder = _read(lock)
        if holder is None or holder.get("token") != me["token"]:  # another job took it over at the same instant
            raise _refusal(folder, holder or {})
    _start_heartbeat()
    return lock


def still_ours(folder: Path) -> Optional[dict[str, Any]]:
    """None while this process holds ``folder``'s claim, else the record now there (or {} when there is none)."""
    holder = _read(Path(folder) / LOCK_NAME)
    return None if holder is not None and holder.get("token") == _token() else (holder or {})


def _beat_once() -> None:
    for lock in list(_claimed.values()):
        with contextlib.suppress(OSError):
            if still_ours(lock.parent) is None:  # never overwrite a claim another job holds now
                os.replace(_write_partial(lock, this_job()), lock)


def _start_heartbeat() -> None:
    global _heartbeat
    if _heartbeat is not None:
        return
    stop, period = threading.Event(), max(lease_seconds() / 10, 0.05)
    _heartbeat = stop

    def beat() -> None:
        while not stop.wait(period):
            _beat_once()

    threading.Thread(target=beat, name="hpz-writer-heartbeat", daemon=True).start()


def _stop_heartbeat() -> None:
    global _heartbeat
    if _heartbeat is not None:
        _heartbeat.set()
        _heartbeat = None


def release(lock: Path) -> None:
    """Remove the claim if it is still this process's."""
    holder = _read(lock)
    if holder is not None and holder.get("token") == _token():
        with contextlib.suppress(OSError):
            lock.unlink()


def claim_for_this_job(folder: Path) -> None:
    """Collective, at every save: rank 0 claims ``folder`` (once) or checks it still holds it; a refusal is raised on
    every rank alike, before the save touches the folder."""
    key = str(Path(folder).resolve())
    refusal, lock = None, None
    if collectives.rank() == 0:
        try:
            if key in _claimed:
                holder = still_ours(Path(folder))
                if holder is not None:
                    raise _refusal(folder, holder)
            else:
                lock = claim(Path(folder))
        except CheckpointStorageError as error:
            refusal = str(error)
        except OSError as error:  # raised here alone, the other ranks would wait in the broadcast
            refusal = f"Cannot claim checkpoint folder {folder} for this job: {error}."
    refusal = collectives.broadcast_object(refusal)
    if refusal is not None:
        raise CheckpointStorageError(refusal)
    if key in _claimed:
        return
    if not _claimed:
        atexit.register(release_all)  # a Fabric script may never call teardown
    _claimed[key] = lock or Path(folder) / LOCK_NAME


def release_all() -> None:
    """At teardown (or exit): give up every folder this process claimed."""
    atexit.unregister(release_all)
    _stop_heartbeat()
    while _claimed:
        release(_claimed.popitem()[1])
