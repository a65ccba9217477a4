"""The strategy destroys a gloo process group at interpreter exit after a normal end, and leaves it alone when an
uncaught exception ends the process (lifecycle/process_group_exit.py), in a fresh one-rank process each."""

import socket
import subprocess
import sys

import pytest

SCRIPT = """
import atexit, os, sys
import torch.distributed as dist
# registered first, so it runs last: it sees what the package's handler left
atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
from lightning_hpz.lifecycle.process_group_exit import destroy_gloo_groups_at_exit
destroy_gloo_groups_at_exit()
destroy_gloo_groups_at_exit()  # once per process, however often a strategy sets up
if sys.argv[1] == "raise":
    raise RuntimeError("the user's script failed")
"""


def _free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


@pytest.mark.parametrize(("ending", "initialized"), [("normal", "False"), ("raise", "True")])
def test_gloo_group_is_destroyed_at_a_normal_exit_only(ending, initialized):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, ending, _free_port()], capture_output=True, text=True, timeout=120
    )
    assert f"initialized at exit: {initialized}" in done.stdout, done.stdout + done.stderr[-2000:]
    assert done.returncode == (0 if ending == "normal" else 1), done.stderr[-2000:]
    assert "terminate called" not in done.stderr
