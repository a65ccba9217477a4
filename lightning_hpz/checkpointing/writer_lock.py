"""One training job writes a checkpoint folder: a second one is refused at its first save, naming the first.

Two jobs saving into one folder delete each other's staged copies (a save clears what it finds in staging), number
their preemption checkpoints from the same ``hpc_ckpt_<N>`` and retire each other's, and a manifest can then vouch for
a mix. Rank 0 claims the folder at its first save with ``.hpz-writer.json`` (job, host, process, a random token, and a
heartbeat: the file is rewritten every tenth of the lease while the process lives) and releases it at teardown, or
when the process exits (a Fabric script may never call teardown).

The claim is created exclusively (a hard link of a complete file, which fails if the lock exists), so two jobs
starting at once cannot both create it. A claim that may be taken over is first renamed aside, which only one
claimer can do, and the exclusive create follows; every later save checks the token again before it touches the
folder. Taken over: a claim by the same job (a requeued SLURM job, a restarted torchrun job), one left on this host
by a process that no longer exists, or one not rewritten for longer than the lease (a job killed on another node:
without the lease its folder stayed locked until someone deleted the file by hand, and its interrupted commits
unrepaired). The age is the file's modification time against a probe file's, both stamped by the storage on NFS and
local disks, so the hosts' clocks do not matter there (Lustre stamps with the writing client's clock: keep clocks
within the lease). The lease is the holder's (recorded in the claim) if longer than the claimer's. A lock that cannot
be read (permissions, a stale handle) counts as held. Any other claim is refused with what to do.

Not ``flock``/``filelock``: the jobs to keep apart run on different nodes, and on Lustre a lock is seen across nodes
only under the ``flock`` mount option; under ``localflock`` every node's lock succeeds (no exclusion, no error) and
without either the call fails. A file created exclusively and renamed is atomic on every file system supported.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from lightning_hpz import collectives
from lightning_hpz.checkpointing.errors import CheckpointStorageError

log = logging.getLogger(__name__)

LOCK_NAME = ".hpz-writer.json"
LEASE_ENV_VAR = "LIGHTNING_HPZ_WRITER_LEASE_S"
DEFAULT_LEASE_S = 300.0  # a claim not rewritten for this long is a dead job's
_BEING_WRITTEN_S = 10.0  # an unreadable lock younger than this is a claim being written (no hard links)
_claimed: dict[str, Path] = {}  # folder -> the lock this process holds there
_tokens: dict[int, str] = {}  # process id -> the token of its claims
_guard = threading.Lock()  # a beat and a release never interleave: a release is final
_heartbeat: Optional[tuple[threading.Event, threading.Thread]] = None


def _token() -> str:
    """This process's token: drawn per process id, so that ranks forked from one pre-imported parent differ."""
    return _tokens.setdefault(os.getpid(), uuid.uuid4().hex)


def lease_seconds() -> float:
    raw = os.environ.get(LEASE_ENV_VAR)
    try:
        lease = float(raw) if raw else DEFAULT_LEASE_S
    except ValueError:
        lease = -1.0
    if lease <= 0:
        log.warning("%s=%r is not a positive number of seconds; using %s.", LEASE_ENV_VAR, raw, DEFAULT_LEASE_S)
        return DEFAULT_LEASE_S
    return lease


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
    record = {"job": job, "host": host, "pid": pid, "since": since, "beat": now, "token": _token()}
    return {**record, "lease": lease_seconds()}


def _read(lock: Path) -> Optional[dict[str, Any]]:
    """The claim in ``lock``; None when there is none or it is not a claim (garbage, cut short). A lock that exists
    but cannot be read raises OSError: it may be a live claim."""
    try:
        record = json.loads(lock.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _same_writer(holder: dict[str, Any], me: dict[str, Any]) -> bool:
    if holder.get("job") and holder.get("job") == me["job"]:
        return True  # requeued or restarted: the same job
    return holder.get("host") == me["host"] and holder.get("pid") == me["pid"]


def _age_on_storage(path: Path) -> Optional[float]:
    """Seconds since ``path`` was last written, by the storage's clock (a probe file's time beside it)."""
    probe = path.with_name(f"{path.name}.{uuid.uuid4().hex}.age")
    try:
        with open(path, "rb") as stream:  # opened: NFS revalidates the attributes (close-to-open), no cached mtime
            written = os.fstat(stream.fileno()).st_mtime
        probe.touch()
        try:
            return probe.stat().st_mtime - written
        finally:
            probe.unlink(missing_ok=True)
    except OSError:
        return None


def _gone(holder: dict[str, Any], me: dict[str, Any], lock: Path) -> bool:
    """The holder no longer writes: its claim was not rewritten for a lease (any host), or its process is gone."""
    age, lease = _age_on_storage(lock), lease_seconds()
    with contextlib.suppress(TypeError, ValueError):
        lease = max(lease, float(holder.get("lease") or 0))  # the holder beats at its own lease's pace
    if age is not None and age > lease:
        return True  # no heartbeat for a lease: its job is dead
    if holder.get("host") != me["host"]:
        return False  # alive by its heartbeat
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, KeyError, TypeError, ValueError, OverflowError):
        return False
    return False


def _takeable(lock: Path, holder: Optional[dict[str, Any]], me: dict[str, Any]) -> bool:
    if holder is None:  # unreadable: garbage, unless a claim is being written this instant
        age = _age_on_storage(lock)
        return age is None or age > _BEING_WRITTEN_S
    return _same_writer(holder, me) or _gone(holder, me, lock)


def held_by_another_job(folder: Path) -> Optional[dict[str, Any]]:
    """The claim of another job that may still be writing ``folder`` (one that is not this job, nor gone), or None."""
    lock, me = Path(folder) / LOCK_NAME, this_job()
    holder = _read(lock)
    if holder is not None and not _same_writer(holder, me) and not _gone(holder, me, lock):
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
    """Create ``lock`` holding ``record`` unless it exists."""
    partial = _write_partial(lock, record)
    try:
        os.link(partial, lock)  # complete at once, and fails if the lock exists: one of two claimers creates it
        return True
    except FileExistsError:
        return False
    except OSError:  # a file system without hard links: an exclusive create, written after (see _takeable)
        try:
            with open(lock, "x") as stream:
                stream.write(json.dumps(record))
            return True
        except FileExistsError:
            return False
    finally:
        with contextlib.suppress(OSError):
            partial.unlink()


def _set_aside(lock: Path, judged: Optional[dict[str, Any]]) -> bool:
    """Move the claim judged takeable out of the way; False if what was moved is not it (another claimer was faster:
    its new claim is put back)."""
    aside = lock.with_name(f"{lock.name}.{uuid.uuid4().hex}.taken")
    try:
        os.rename(lock, aside)  # of two claimers renaming one file, one succeeds
    except FileNotFoundError:
        return True  # already moved by another claimer: the exclusive create decides
    moved = _read(aside)
    if moved != judged:  # another claimer's new claim: back where it was
        _put_back(aside, lock)
        return False
    aside.unlink(missing_ok=True)
    return True


def _put_back(aside: Path, lock: Path) -> None:
    try:
        os.link(aside, lock)  # back, unless yet another claim is there
    except FileExistsError:
        pass
    except OSError:  # no hard links: an exclusive create of the same bytes
        with contextlib.suppress(FileExistsError), open(lock, "xb") as stream:
            stream.write(aside.read_bytes())
    aside.unlink(missing_ok=True)


def claim(folder: Path) -> Path:
    """Claim ``folder`` for this job (rank 0 only); raises :class:`CheckpointStorageError` if another job holds it."""
    lock, me = Path(folder) / LOCK_NAME, this_job()
    for _ in range(3):
        if _create_exclusively(lock, me):
            _start_heartbeat()
            return lock
        holder = _read(lock)
        if holder is not None and holder.get("token") == me["token"]:
            _start_heartbeat()
            return lock  # this process's own claim (a save that asked again)
        if not _takeable(lock, holder, me):
            raise _refusal(folder, holder or {})
        if not _set_aside(lock, holder):
            raise _refusal(folder, _read(lock) or {})
    raise _refusal(folder, _read(lock) or {})  # claimed and taken over by others three times: contended


def still_ours(folder: Path) -> Optional[dict[str, Any]]:
    """None while this process holds ``folder``'s claim, else the record now there (or {} when there is none)."""
    holder = _read(Path(folder) / LOCK_NAME)
    return None if holder is not None and holder.get("token") == _token() else (holder or {})


def _beat_once(stop: threading.Event) -> None:
    with _guard:
        if stop.is_set():
            return  # released meanwhile: a beat now would bring the claim back
        for lock in list(_claimed.values()):
            with contextlib.suppress(OSError):
                holder = _read(lock)
                if holder is not None and holder.get("token") == _token():  # never overwrite another job's claim
                    partial = _write_partial(lock, {**holder, "beat": time.time()})
                    try:
                        os.replace(partial, lock)
                    finally:
                        partial.unlink(missing_ok=True)


class _Heartbeat(threading.Thread):
    """Renews this process's claims. A daemon with ``stop()``, the contract by which Lightning's own test harness
    ends a thread a Fabric script left running (Fabric never calls the strategy's teardown)."""

    def __init__(self, stopped: threading.Event, period: float) -> None:
        super().__init__(name="hpz-writer-heartbeat", daemon=True)
        self.stopped, self.period = stopped, period

    def run(self) -> None:
        while not self.stopped.wait(self.period):
            _beat_once(self.stopped)

    def stop(self) -> None:
        _stop_heartbeat()


def _start_heartbeat() -> None:
    global _heartbeat
    if _heartbeat is not None:
        return
    stop = threading.Event()
    thread = _Heartbeat(stop, max(lease_seconds() / 10, 0.05))
    _heartbeat = (stop, thread)
    thread.start()


def _stop_heartbeat() -> None:
    global _heartbeat
    if _heartbeat is not None:
        stop, thread = _heartbeat
        stop.set()
        _heartbeat = None
        if thread is not threading.current_thread():
            thread.join(timeout=30)


def release(lock: Path) -> None:
    """Remove the claim if it is still this process's."""
    with contextlib.suppress(OSError):
        holder = _read(lock)
        if holder is not None and holder.get("token") == _token():
            lock.unlink()


def claim_for_this_job(folder: Path) -> None:
    """Collective, at every save: rank 0 claims ``folder`` (once) or checks it still holds it; a refusal is raised on
    every rank alike, before the save touches the folder."""
    key = str(Path(folder).resolve())
    refusal, lock = None, None
    if collectives.rank() == 0:
        try:
            lock = _claim_or_confirm(Path(folder), key)
        except CheckpointStorageError as error:
            refusal = str(error)
        except Exception as error:  # raised here alone, the other ranks would wait in the broadcast
            refusal = f"Cannot claim checkpoint folder {folder} for this job: {type(error).__name__}: {error}."
    refusal = collectives.broadcast_object(refusal)
    if refusal is not None:
        raise CheckpointStorageError(refusal)
    if key in _claimed:
        return
    if not _claimed:
        atexit.register(release_all)  # a Fabric script may never call teardown
    _claimed[key] = lock or Path(folder) / LOCK_NAME


def _claim_or_confirm(folder: Path, key: str) -> Optional[Path]:
    if key not in _claimed:
        return claim(folder)
    holder = still_ours(folder)
    if holder == {}:  # deleted by hand (or by a cleanup): claimed again, as at the first save
        return claim(folder)
    if holder is not None:
        raise _refusal(folder, holder)
    return None


def release_all() -> None:
    """At teardown (or exit): give up every folder this process claimed."""
    atexit.unregister(release_all)
    _stop_heartbeat()
    with _guard:
        while _claimed:
            release(_claimed.popitem()[1])


def _forget_inherited_claims() -> None:
    """In a child forked while claims were held: they are the parent's, and so is the heartbeat thread."""
    global _heartbeat, _guard
    _claimed.clear()
    _heartbeat = None
    _guard = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_inherited_claims)
