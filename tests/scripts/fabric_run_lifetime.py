"""A Fabric loop that never calls ``teardown`` (as LitGPT's do not), and what the run costs the rendezvous store.

Run as ``python fabric_run_lifetime.py '<json options>'`` (Fabric's launcher starts the other ranks; every rank is a
whole interpreter, so interpreter exit runs as in a user's script) or from the warm launcher. Each rank writes
``rank<r>.json``:

- ``ledger``: over a window of training steps, the watchdog's beats and store requests on this rank, and (rank 0)
  the bytes the store's server sockets received and sent (``ss``), for the scale ledger;
- ``threads``, ``store_connections``: the package's threads while training (name, daemon, has ``stop``), and this
  process's connections to the store;
- with ``harness_rank``: that rank, ``slower_s`` seconds after the others finished, destroys the process group as
  Lightning's test harness does between tests, and records the package threads alive right after (each must be a
  daemon with a ``stop``, the harness's contract) and after up to 3 s (none). The other ranks just end: the
  watchdog leaves at interpreter exit, and rank 0 writes ``exit_of_rank0.json`` from its last exit handler (threads
  still alive, seconds spent at exit waiting for the slower rank).
- with ``saves``: every rank saves that many times after training (claiming the folder, replacing a copy), and the
  rank 0 (the writer) then does what Lightning's harness does with the checkpoint threads left (``police``).
"""

import atexit
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import lightning as L
import torch

import lightning_hpz


def _ours(thread: threading.Thread) -> bool:
    return thread.name.startswith(("lightning-hpz", "hpz-"))


def package_threads(watchdog_only: bool = True) -> list[dict]:
    return [
        {"name": t.name, "daemon": t.daemon, "stop": callable(getattr(t, "stop", None))}
        for t in threading.enumerate()
        if _ours(t) and (not watchdog_only or (t.name.startswith("lightning-hpz-") and "deletion" not in t.name))
    ]


def _checkpoint_threads() -> list[dict]:
    watchdog = {t["name"] for t in package_threads()}
    return [t for t in package_threads(watchdog_only=False) if t["name"] not in watchdog]


def police_checkpoint_threads() -> dict:
    """What Lightning's test harness does with the threads a test left, for the checkpoint writer's (the lock's
    heartbeat, the deletion of a replaced copy; rank 0's alone): a daemon with ``stop`` is stopped, any other thread
    fails the test. Returns those found, and those still alive 3 s after stopping them."""
    found = _checkpoint_threads()
    for thread in threading.enumerate():
        if any(t["name"] == thread.name for t in found) and thread.daemon and callable(getattr(thread, "stop", None)):
            thread.stop()
    deadline = time.monotonic() + 3
    while _checkpoint_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"found": found, "left": _checkpoint_threads()}


def store_bytes(port: int) -> int:
    """Bytes received and sent by the sockets the store's server accepted (local port ``port``), from ``ss``."""
    listing = subprocess.run(["ss", "-tinH", f"( sport = :{port} )"], capture_output=True, text=True).stdout
    return sum(int(value) for value in re.findall(r"bytes_(?:received|sent):(\d+)", listing))


def store_connections(port: int) -> int:
    """This process's TCP connections to the store's port."""
    listing = subprocess.run(["ss", "-tnpH", f"( dport = :{port} )"], capture_output=True, text=True).stdout
    return sum(1 for line in listing.splitlines() if f"pid={os.getpid()}," in line)


def sample(watchdog, port: int) -> dict:
    return watchdog.ledger() | {"bytes": store_bytes(port)}


def at_exit_record(out: Path, finished: list) -> None:
    threads = package_threads()
    waited = time.monotonic() - finished[0] if finished else None
    (out / "exit_of_rank0.json").write_text(json.dumps({"threads": threads, "exit_waited_s": waited}))


def main(options: dict) -> None:
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    finished: list = []
    if os.environ.get("LOCAL_RANK", "0") == "0" and "harness_rank" in options:
        atexit.register(at_exit_record, out, finished)  # before the watchdog's: runs after it (last in, first out)
    strategy = lightning_hpz.HpzFabricStrategy(
        stage=2, heartbeat_interval=options["interval"], peer_timeout=options["timeout"]
    )
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=options["devices"])
    fabric.launch()
    fabric.seed_everything(0)
    model = torch.nn.Linear(8, 1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    watchdog, port = strategy.peer_watchdog, int(os.environ["MASTER_PORT"])
    record: dict = {"threads": package_threads(), "store_connections": store_connections(port)}
    window = options["window"]
    for step in range(window[1] + 1):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step in window:  # every rank at the same step: the steps' collectives keep them together
            record.setdefault("ledger", []).append(sample(watchdog, port) | {"time": time.monotonic()})
        time.sleep(options["step_s"])
    if options.get("saves"):  # the writer lock's heartbeat runs from the first save, a replaced copy's deletion after
        for _ in range(options["saves"]):
            fabric.save(out / "checkpoint", {"model": model, "optimizer": optimizer})
    if fabric.global_rank == options.get("harness_rank"):
        time.sleep(options["slower_s"])
        torch.distributed.destroy_process_group()
        record["threads_right_after_destroy"] = package_threads()
        deadline = time.monotonic() + 3
        while package_threads() and time.monotonic() < deadline:
            time.sleep(0.05)
        record["threads_after_destroy"] = package_threads()
    elif "harness_rank" not in options:
        strategy.teardown()
    if options.get("saves") and fabric.global_rank == 0:
        record["police"] = police_checkpoint_threads()
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(record))
    finished.append(time.monotonic())


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
