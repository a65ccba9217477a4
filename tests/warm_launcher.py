"""Launch a script's ranks as torchrun would, but forked from one process that has already imported the stack.

Importing torch, Lightning, DeepSpeed and this package costs about 10 s of CPU per process; a 4-rank launch on a
2-core machine spends most of its wall time there. The server below imports once per test session, then forks each
launch's ranks with torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``TORCHELASTIC_RUN_ID``, ...),
so Lightning finds externally created processes exactly as under ``torchrun script.py``. Only the start-up is shared:
each rank runs the script as ``__main__`` in its own process, with its own process group, files and failures.

The server never touches a tensor before forking (no thread pools exist to copy into a child) and forks a fresh
launcher per request, which forks the ranks, so nothing one launch does can leak into the next.

Protocol: one JSON request per line on stdin, one JSON reply per line on stdout (``{"returncode": int}``).
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

FAILURE_GRACE_SECONDS = 15  # as torchrun: once one rank fails, the others get this long before they are killed


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now (for a launch's ``MASTER_PORT``)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _rank_environment(request: dict, rank: int, port: int) -> dict:
    ranks = request["ranks"]
    return {
        **request["env"],
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(ranks),
        "LOCAL_WORLD_SIZE": str(ranks),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(ranks),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": "warm-launcher",
    }


def _run_rank(request: dict, rank: int, port: int, log_fd: int) -> None:
    """In the forked rank: become a fresh torchrun worker and run the script as ``__main__``; never returns."""
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the server's requests are not the rank's input
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.environ.clear()
    os.environ.update(_rank_environment(request, rank, port))
    os.chdir(request["cwd"])
    sys.argv = [request["script"], *request["args"]]
    sys.path[0] = os.path.dirname(request["script"])
    code = 0
    try:
        runpy.run_path(request["script"], run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # any failure becomes the rank's exit code, as in an interpreter
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _launch(request: dict) -> int:
    """In the forked launcher: fork the ranks, wait, stop the rest once one fails; the worst exit code."""
    os.setpgid(0, 0)  # the server kills this group on a timeout: launcher and ranks together
    log_fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    port = free_port()
    children = {}
    for rank in range(request["ranks"]):
        pid = os.fork()
        if pid == 0:
            _run_rank(request, rank, port, log_fd)
        children[pid] = rank
    worst, failed_at = 0, None
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if failed_at is not None and time.monotonic() - failed_at > FAILURE_GRACE_SECONDS:
                for other in children:
                    os.kill(other, signal.SIGKILL)
            time.sleep(0.05)
            continue
        children.pop(pid, None)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            worst = worst or (code if code > 0 else 128 - code)
            failed_at = failed_at or time.monotonic()
    return worst


def _serve_one(request: dict) -> int:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = _launch(request)
        finally:
            os._exit(code)
    deadline = time.monotonic() + request["timeout"]
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            with open(request["log"], "a") as log:
                log.write(f"\nwarm_launcher: killed after {request['timeout']} s\n")
            return -9
        time.sleep(0.05)


def serve() -> None:
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what imported code prints (DeepSpeed logs to stdout) must not corrupt the protocol
    import deepspeed  # noqa: F401 - the imports every rank would otherwise pay for
    import lightning
    import lightning.pytorch  # noqa: F401
    import torch  # noqa: F401

    import lightning_hpz
    import lightning_hpz.strategy.trainer_strategy  # noqa: F401
    from lightning_hpz.partitioning.cpu_comm_op import prepare_cpu_comm_op

    prepare_cpu_comm_op()  # built once here (as Lightning's launcher does) rather than by every rank at once

    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    for line in sys.stdin:
        replies.write(json.dumps({"returncode": _serve_one(json.loads(line))}) + "\n")
        replies.flush()


class WarmLauncher:
    """The test side: starts the server on first use (one per test session) and runs launches through it."""

    def __init__(self) -> None:
        self._server: subprocess.Popen | None = None

    def run(self, script: str, args: list[str], cwd: str, env: dict, ranks: int, timeout: float) -> tuple[int, str]:
        """(worst exit code of the ranks, their interleaved output) of one launch of ``ranks`` ranks."""
        server = self._started()
        log = os.path.join(cwd, f".warm-launch-{time.monotonic_ns()}.log")
        request = {"script": script, "args": args, "cwd": cwd, "env": env, "ranks": ranks, "log": log}
        server.stdin.write(json.dumps({**request, "timeout": timeout}) + "\n")
        server.stdin.flush()
        reply = server.stdout.readline()
        output = Path(log).read_text() if os.path.exists(log) else ""
        if not reply:
            self.close()
            raise RuntimeError(f"the warm launcher's server died; the launch's output:\n{output[-4000:]}")
        return json.loads(reply)["returncode"], output

    def close(self) -> None:
        if self._server is not None:
            self._server.stdin.close()
            self._server.wait(timeout=30)
            self._server = None

    def _started(self) -> subprocess.Popen:
        if self._server is None:
            command = [sys.executable, __file__]
            self._server = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            if not self._server.stdout.readline():
                raise RuntimeError("the warm launcher's server did not start; its error is printed above")
        return self._server


if __name__ == "__main__":
    serve()
