"""One job per checkpoint folder: another job's live claim is refused naming it; the same job, or a claim left by a
process that is gone or whose heartbeat stopped, is taken over; two jobs claiming at once never both hold it; a refused
save touches nothing of the other job's."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from lightning_hpz.checkpointing.commit import committed_save
from lightning_hpz.checkpointing.errors import CheckpointStorageError
from lightning_hpz.checkpointing.staging import staging_path
from lightning_hpz.checkpointing.writer_lock import (
    DEFAULT_LEASE_S,
    LEASE_ENV_VAR,
    LOCK_NAME,
    claim,
    release,
    this_job,
)


def _claimed_by(folder, **holder):
    (folder / LOCK_NAME).write_text(json.dumps({**this_job(), "token": "another-process", **holder}))


def test_a_live_claim_of_another_job_is_refused_naming_it(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a live process on this host
    try:
        _claimed_by(tmp_path, job="4242", pid=other.pid)
        with pytest.raises(CheckpointStorageError, match=r"being written by job 4242 .* delete .*\.hpz-writer\.json"):
            claim(tmp_path)
    finally:
        other.kill()
        other.wait()


def test_a_claim_of_a_process_that_is_gone_is_taken_over(tmp_path):
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _claimed_by(tmp_path, job="4242", pid=int(ended.stdout))
    lock = claim(tmp_path)
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    release(lock)
    assert not lock.exists()


def test_the_same_job_takes_its_claim_over(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    _claimed_by(tmp_path, job="777", host="another-node", pid=1)  # the job before its requeue, elsewhere
    assert json.loads(claim(tmp_path).read_text())["job"] == "777"


def _last_written(folder, seconds_ago):
    then = time.time() - seconds_ago
    os.utime(folder / LOCK_NAME, (then, then))


def test_a_claim_whose_heartbeat_stopped_is_taken_over(tmp_path, monkeypatch):
    # a job killed on another node: its process cannot be looked up from here, its heartbeat tells it is dead
    monkeypatch.setenv(LEASE_ENV_VAR, "60")
    _claimed_by(tmp_path, job="4242", host="another-node", pid=1)
    _last_written(tmp_path, 61)
    assert json.loads(claim(tmp_path).read_text())["pid"] == os.getpid()


def test_a_claim_with_a_recent_heartbeat_on_another_node_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(LEASE_ENV_VAR, "60")
    _claimed_by(tmp_path, job="4242", host="another-node", pid=1, beat=0)  # its clock says nothing: the file's age does
    _last_written(tmp_path, 5)
    with pytest.raises(CheckpointStorageError, match=r"job 4242 \(host another-node.*expires 60 s"):
        claim(tmp_path)


def test_the_heartbeat_keeps_a_live_claim_fresh(tmp_path, monkeypatch):
    monkeypatch.setenv(LEASE_ENV_VAR, "1")  # a beat every 0.1 s
    from lightning_hpz.checkpointing import writer_lock

    writer_lock.release_all()  # a heartbeat started by an earlier claim in this process runs at the default period
    writer_lock.claim_for_this_job(tmp_path)
    try:
        first = json.loads((tmp_path / LOCK_NAME).read_text())["beat"]
        time.sleep(0.5)
        assert json.loads((tmp_path / LOCK_NAME).read_text())["beat"] > first
    finally:
        writer_lock.release_all()
    assert not (tmp_path / LOCK_NAME).exists()
    time.sleep(0.3)  # three periods: a beat in flight at the release must not bring the claim back
    assert not (tmp_path / LOCK_NAME).exists()


CLAIM_AT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from lightning_hpz.checkpointing.writer_lock import claim
    from lightning_hpz.checkpointing.errors import CheckpointStorageError

    while time.time() < float(sys.argv[2]):
        pass
    try:
        claim(Path(sys.argv[1]))
        print("claimed")
    except CheckpointStorageError:
        print("refused")
    """
)


@pytest.mark.parametrize("left_by_a_dead_job", [False, True])
@pytest.mark.parametrize("attempt", range(3))
def test_two_jobs_claiming_at_the_same_instant_never_both_hold_the_folder(tmp_path, attempt, left_by_a_dead_job):
    if left_by_a_dead_job:  # both judge it takeable; only one may take it over
        _claimed_by(tmp_path, job="4242", host="another-node", pid=1)
        _last_written(tmp_path, 2 * DEFAULT_LEASE_S)
    start = time.time() + 3  # both processes are imported and spinning by then
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    jobs = [
        subprocess.Popen(
            [sys.executable, "-c", CLAIM_AT, str(tmp_path), str(start)],
            env={**env, "SLURM_JOB_ID": str(job)},
            stdout=subprocess.PIPE,
            text=True,
        )
        for job in (101, 102)
    ]
    outcomes = sorted(job.communicate(timeout=60)[0].strip() for job in jobs)
    assert outcomes == ["claimed", "refused"]


def test_a_save_refused_by_another_jobs_claim_leaves_its_staged_copy_alone(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _claimed_by(tmp_path, job="4242", pid=other.pid)
        staged = staging_path(tmp_path / "last.ckpt")
        staged.mkdir(parents=True)
        (staged / "shard.pt").write_bytes(b"the other job's shard, being written")
        refused = pytest.raises(CheckpointStorageError, match="being written by job 4242")
        with refused, committed_save(tmp_path / "last.ckpt", {"global_step": 1}) as staging:
            torch.save({}, staging / "never.pt")
        assert (staged / "shard.pt").read_bytes() == b"the other job's shard, being written"
    finally:
        other.kill()
        other.wait()


def test_a_claim_kept_alive_at_a_longer_lease_is_not_taken_over(tmp_path, monkeypatch):
    # the holder beats every tenth of its own lease: judged by this job's shorter one, it would look dead between beats
    monkeypatch.setenv(LEASE_ENV_VAR, "60")
    _claimed_by(tmp_path, job="4242", host="another-node", pid=1, lease=3000)
    _last_written(tmp_path, 200)
    with pytest.raises(CheckpointStorageError, match="being written by job 4242"):
        claim(tmp_path)


def test_a_lock_that_cannot_be_read_counts_as_held(tmp_path, monkeypatch):
    _claimed_by(tmp_path, job="4242", host="another-node", pid=1)
    _last_written(tmp_path, 2 * DEFAULT_LEASE_S)
    original = Path.read_text

    def unreadable(path, *args, **kwargs):
        if path.name == LOCK_NAME:
            raise PermissionError(13, "Permission denied", str(path))
        return original(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", unreadable)
    with pytest.raises(PermissionError):
        claim(tmp_path)
    monkeypatch.undo()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["job"] == "4242"  # left in place
