"""One job per checkpoint folder: another job's live claim is refused naming it; the same job, or a claim left by a
process that is gone, is taken over."""

import json
import os
import subprocess
import sys

import pytest

from lightning_hpz.checkpointing.errors import CheckpointStorageError
from lightning_hpz.checkpointing.writer_lock import LOCK_NAME, claim, release, this_job


def _claimed_by(folder, **holder):
    (folder / LOCK_NAME).write_text(json.dumps({**this_job(), **holder}))


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
