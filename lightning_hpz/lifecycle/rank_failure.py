"""What a rank does when the Trainer raises on it: let every rank leave its collectives, kill only those stuck.

A rank that raises stops joining collectives, so its peers would wait in their next one until the process-group
timeout (30 minutes by default). Killing them all at once ends that, but also kills ranks that caught the error and
are running their own clean-up. Instead, a failing rank

1. writes "I have left the collectives" into the process group's store, under its rank;
2. aborts its process groups: its collectives are out of step with its peers' now, so none may run any more. Where
   that closes the connections (gloo, for a group nothing else still holds), a peer blocked in a collective with it
   gets an error, raises, reaches this same handler and runs the user's ``except`` code;
3. if it launched the other ranks of its node (Lightning's subprocess launcher), gives them ``grace_period`` seconds
   to do the same or exit, then kills only those that did neither: ranks stuck where no abort reaches them. Measured
   on gloo: DeepSpeed keeps references to its process groups, so a peer waiting in an all-gather of one of them is
   not released by the abort and ends here, as does a rank in an NCCL kernel waiting for the failed peer.

Not covered: a failure on a rank that did not launch the others, caught there, while the launching rank is blocked
under NCCL: it waits until the failed rank exits with an error (Lightning's child observer then ends it) or for
the NCCL timeout.
"""

from __future__ import annotations

import atexit
import logging
import signal
import subprocess
import threading
import time
from typing import Any, Optional

from lightning_hpz import collectives

log = logging.getLogger(__name__)
DEFAULT_GRACE_PERIOD_S = 30.0
_POLL_S = 0.5


def left_collectives_key(rank: int) -> str:
    return f"lightning_hpz/left_collectives/{rank}"


def release_peers(children: Optional[list[subprocess.Popen]], grace_period: float) -> Optional[threading.Thread]:
    """Steps 1-3 above for this rank; returns the thread that watches this node's children, if there are any."""
    if collectives.world_size() <= 1:
        return None  # no peer to release: the process group stays usable (a notebook may call fit again)
    store = collectives.default_store()
    rank = collectives.rank()
    _mark_left(store, rank)
    collectives.abort_process_groups()
    if not children or store is None:
        return None
    child_ranks = [rank + 1 + index for index in range(len(children))]  # Lightning's launcher numbers them so
    watcher = threading.Thread(
        target=kill_stuck_children,
        args=(children, child_ranks, store, grace_period),
        name="lightning-hpz-stuck-rank-reaper",
        daemon=True,
    )
    watcher.start()
    # Finish the watch before the interpreter shuts down: a launcher that exits early must not leave a stuck child
    # behind, and the store (kept alive for the children's marks) must be released while the runtime still runs.
    atexit.register(watcher.join)
    return watcher


def _mark_left(store: Any, rank: int) -> None:
    if store is None:
        return
    try:
        store.set(left_collectives_key(rank), "1")
    except Exception as err:  # the store lives in rank 0: if it is gone, the launcher's grace period decides
        log.debug(f"rank {rank} could not mark that it left the collectives: {err}")


def kill_stuck_children(children: list[subprocess.Popen], ranks: list[int], store: Any, grace_period: float) -> None:
    """After ``grace_period`` s, SIGKILL every child still running that has not marked that it left the collectives.

    A killed child is first taken out of ``children`` (Lightning's launcher ``procs``, the list its child-process
    observer polls): that observer kills the launching rank when it sees a child die, and this rank is busy
    handling its own error.
    """
    ranked = list(zip(children, ranks, strict=True))  # fixed before `children` shrinks
    deadline = time.monotonic() + grace_period
    while time.monotonic() < deadline and _stuck(ranked, store):
        time.sleep(_POLL_S)
    for proc, rank in _stuck(ranked, store):
        log.warning(f"rank {rank} (pid {proc.pid}) is still blocked {grace_period:.0f} s after a failure: killing it")
        children.remove(proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def _stuck(ranked: list[tuple[subprocess.Popen, int]], store: Any) -> list[tuple[subprocess.Popen, int]]:
    return [(proc, rank) for proc, rank in ranked if proc.poll() is None and not _has_left(store, rank)]


def _has_left(store: Any, rank: int) -> bool:
    try:
        return bool(store.check([left_collectives_key(rank)]))
    except Exception:  # a store that cannot answer cannot vouch for the rank
        return False
