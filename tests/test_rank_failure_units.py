"""Which children the launching rank kills after a failure: only those neither marked as out of collectives nor
exited when the grace period ends. Plain child processes and torch's in-memory store, no DeepSpeed."""

import subprocess
import sys
import threading

import torch.distributed as dist

from lightning_hpz.lifecycle.rank_failure import kill_stuck_children, left_collectives_key


def _child(seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def test_only_unmarked_running_children_are_killed_and_forgotten():
    stuck, handling, finished = _child(60), _child(60), _child(0)
    finished.wait()
    store = dist.HashStore()
    store.set(left_collectives_key(2), "1")  # rank 2 reached its own error handling
    children = [stuck, handling, finished]
    try:
        kill_stuck_children(children, [1, 2, 3], store, grace_period=0.5)
        assert stuck.returncode == -9
        assert handling.poll() is None  # still running its clean-up
        # the launcher's list (polled by Lightning's child observer) no longer holds the killed rank
        assert children == [handling, finished]
    finally:
        for proc in (stuck, handling):
            proc.kill()
            proc.wait()


def test_children_that_all_left_end_the_watch_before_the_grace_period():
    store = dist.HashStore()
    child = _child(60)
    store.set(left_collectives_key(1), "1")
    watch = threading.Thread(target=kill_stuck_children, args=([child], [1], store, 600.0), daemon=True)
    try:
        watch.start()
        watch.join(timeout=60)
        assert not watch.is_alive()  # nobody stuck: no need to wait out the 600 s
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()
