"""A lost node or a cut link ends the run in about a minute, with exit code 76 and a message naming who is gone.

Without this, the ranks that survive a node's loss (power, kernel panic, every rank OOM-killed) or a cut inter-node
link wait in their collective until the process-group timeout, 30 minutes by default; under NCCL even a failing
rank's abort does not wake the ranks of other nodes. Design, with the reasons:

- **Heartbeats through the job's rendezvous store.** Every rank starts two daemon threads at set-up. The *beat*
  thread writes ``lightning_hpz/heartbeat/<rank>`` every ``interval`` seconds (a fresh value each time) and reads
  every peer's key in one ``multi_get``; the *judge* thread compares, on this machine's monotonic clock, when each
  peer's value last changed (no clock is compared across machines). The store is the one the default process group
  was built on (Lightning's ``MASTER_ADDR:MASTER_PORT`` TCPStore, or torchrun's): it exists in every launch, needs no
  port or group of its own, and carries no bulk traffic. A gloo side group with a short timeout would instead need
  a collective every rank joins in step, which a rank blocked in a long NCCL kernel cannot do. Every rank watches for
  itself: one rank's exit would not end the others (a node's rank 0 does not own its node's ranks under torchrun).
  Cost per interval and rank: one ``set`` and one ``multi_get`` of ``world_size`` keys (a few bytes each).
- **Store calls never block the decision.** The beat thread talks to the store over a connection of its own
  (``store.clone()``, timeout ``interval * 2`` at most 15 s), so the training thread's store calls keep their own
  timeout; a call that hangs on a dead link only delays that thread. The judge never touches the network: when no
  store call has succeeded for ``timeout`` seconds, the store itself is unreachable. The store is served from rank 0's
  node, so that is how rank 0's node's loss, or a cut link seen from the other nodes, shows: the message names the
  store's address and rank 0's node.
- **Lost after ``timeout`` seconds of silence, default 45 s.** Measured on the two-node testbed (README "Lost nodes
  and cut links"): with the link slowed 100-fold (200 -> 2 Mbit/s) and full of ZeRO-3 all-gathers (a step took 7.5 s
  instead of 0.5 s), the slowest heartbeat round trip was 0.96 s and 1.13 s in two runs (0.05 s from the store's
  own node). 45 s leaves a margin of over 35 times that for links and loads worse than the testbed's, and still
  exits within the 60 s goal: detection takes at most ``timeout + interval`` seconds after the last beat heard
  (42-49 s measured), the exit follows at once.
  A peer that keeps beating is never declared lost, however slow its steps: the beats run beside training, so a
  long checkpoint save, the first step's compilation, or a slow link does not stop them (``torch.save`` releases the
  GIL: a 0.8 GB save left a Python thread's longest pause at 76 ms, measured here). When this process itself was
  stopped (a judge tick late by over ``timeout / 3``, e.g. SIGSTOP, swap), peers get a fresh ``timeout``.
- **A rank that ends cleanly says so.** At teardown (and at interpreter exit, for a Fabric script that never calls
  teardown) a rank writes ``left`` into its key: a peer that finishes its run later does not take it for lost. Rank
  0, whose process serves the store under Lightning's launchers, then waits until every live peer has left, so that a
  slower peer does not take the store's disappearance for a lost node.
- **The exit is ``os._exit(76)``, from the judge thread.** A rank blocked inside a collective cannot be unblocked
  otherwise, and no collective may run on the way out (it would block the same way). 76 is sysexits' ``EX_PROTOCOL``
  ("remote error"): distinct from 0, 3, 4, 75 and a crash's 1 or signal codes. Before exiting the rank prints which
  ranks are silent on which node, or that the store is unreachable, and the last checkpoint committed by this run.
  A save in flight at that moment is abandoned in its staging folder: the commit is atomic
  (``checkpointing/commit.py``), so the previous committed checkpoint stays the newest and intact.

- **A failed collective is explained before it is handled.** When a Trainer rank's collective raises (gloo's
  "Connection closed by peer" when a node's ranks were killed and its kernel closed their connections), the strategy
  first waits until every peer beats again (:meth:`PeerWatchdog.confirm_peers_alive`, about two intervals for live
  peers) and only then runs the usual failure handling (``rank_failure.py``); peers that stay silent end the run
  with 76 and their names instead of a traceback about a socket.

Not covered: a rank that hangs while its process keeps beating (a deadlock inside one node) is alive by this test;
the process-group timeout still ends that.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_hpz.lifecycle.run_exit import PEER_LOST_EXIT_CODE

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 45.0
DEFAULT_INTERVAL_S = 5.0
LEFT = "left"  # the value of a rank's key once it ended its run cleanly
_MAX_CALL_TIMEOUT_S = 15.0


def heartbeat_key(rank: int) -> str:
    return f"lightning_hpz/heartbeat/{rank}"


def check_settings(timeout: Optional[float], interval: float) -> None:
    """Refuse settings under which a live peer would be taken for lost (raised at construction, before any launch)."""
    if timeout is None:
        return
    if interval <= 0:
        raise ValueError(f"heartbeat_interval={interval} must be positive (seconds between beats); default 5.")
    if timeout < 3 * interval:
        raise ValueError(
            f"peer_timeout={timeout} is under three heartbeat intervals ({interval} s): a single late beat would "
            "end the run. Raise peer_timeout, lower heartbeat_interval, or pass peer_timeout=None to turn it off."
        )


@dataclass
class BeatBook:
    """What the judge knows: when each peer's heartbeat last changed and when the store last answered (pure logic,
    every time passed in, so that it is tested without threads or a store)."""

    rank: int
    world_size: int
    timeout: float
    started: float
    last_change: dict[int, float] = field(default_factory=dict)
    values: dict[int, Optional[str]] = field(default_factory=dict)
    left: set[int] = field(default_factory=set)
    changes: dict[int, int] = field(default_factory=dict)  # how many times each peer's value was seen to change
    last_store_answer: float = 0.0
    slowest_round_trip: float = 0.0

    def __post_init__(self) -> None:
        self.last_store_answer = self.started
        for peer in self.peers:
            self.last_change[peer] = self.started
            self.values[peer] = None
            self.changes[peer] = 0

    @property
    def peers(self) -> list[int]:
        return [peer for peer in range(self.world_size) if peer != self.rank]

    def observe(self, values: dict[int, Optional[str]], now: float, round_trip: float) -> None:
        """Record one successful read of the peers' keys (``None``: a peer's key does not exist yet)."""
        self.last_store_answer = now
        self.slowest_round_trip = max(self.slowest_round_trip, round_trip)
        for peer, value in values.items():
            if value == LEFT:
                self.left.add(peer)
            elif value is not None:
                self.left.discard(peer)  # a new run in the same processes beats again
            if value != self.values.get(peer):
                self.values[peer] = value
                self.last_change[peer] = now
                self.changes[peer] = self.changes.get(peer, 0) + 1

    def excuse(self, stalled: float) -> None:
        """This process itself was stopped for ``stalled`` seconds: nobody else is to blame for that time."""
        for peer in self.last_change:
            self.last_change[peer] += stalled
        self.last_store_answer += stalled

    def credit_progress(self, at: Optional[float]) -> None:
        """This rank completed work that needs every peer (a step's collectives) at ``at``: every peer and the link
        were alive then, whatever the heartbeats say. A saturated slow link can starve the beats' connection (its
        packets queue or drop behind the collectives' traffic) while training goes on."""
        if at is None:
            return
        for peer in self.last_change:
            self.last_change[peer] = max(self.last_change[peer], at)
        self.last_store_answer = max(self.last_store_answer, at)

    def store_silent_for(self, now: float) -> float:
        return now - self.last_store_answer

    def silent_peers(self) -> dict[int, float]:
        """Peers whose key was read unchanged for longer than the timeout, with the seconds of silence.

        Counted up to the last read only: while the store does not answer, nobody's silence can be observed (the
        store's own silence decides then), so a cut link is reported as the store's, not as every peer's.
        """
        return {
            peer: self.last_store_answer - changed
            for peer, changed in self.last_change.items()
            if peer not in self.left and self.last_store_answer - changed > self.timeout
        }


def describe_loss(
    book: BeatBook, now: float, node_of: Callable[[int], int], store_address: str, checkpoint: Optional[str]
) -> Optional[str]:
    """The message to exit with, or ``None`` while every peer is beating and the store answers."""
    if book.store_silent_for(now) > book.timeout:
        lost = (
            f"the rendezvous store at {store_address} (served from rank 0's node, node {node_of(0)}) has not "
            f"answered for {book.store_silent_for(now):.0f} s: rank 0's node is lost or the link to it is cut"
        )
    else:
        silent = book.silent_peers()
        if not silent:
            return None
        by_node: dict[int, list[int]] = {}
        for peer in sorted(silent):
            by_node.setdefault(node_of(peer), []).append(peer)
        lost = "; ".join(
            f"node {node} (ranks {', '.join(map(str, ranks))}) silent for {max(silent[r] for r in ranks):.0f} s"
            for node, ranks in sorted(by_node.items())
        )
        lost += ": lost, or the link to it is cut"
    saved = (
        f"the last checkpoint this run committed is {checkpoint}: resume from it once every node is back"
        if checkpoint
        else "no checkpoint committed by this run"
    )
    return (
        f"lightning_hpz: rank {book.rank} (node {node_of(book.rank)}) ends the run with exit code "
        f"{PEER_LOST_EXIT_CODE}: {lost} (no heartbeat within peer_timeout={book.timeout:g} s). Not waiting for the "
        f"process-group timeout; {saved}."
    )


def exit_lost(message: str) -> None:
    """Print ``message`` and end this process at once with :data:`PEER_LOST_EXIT_CODE` (no collective, no clean-up:
    the main thread may be blocked in a collective that will never complete)."""
    if log.hasHandlers():  # a configured log file gets it too; stderr always does, below
        log.error(message)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    with contextlib.suppress(OSError):
        os.write(2, (message + "\n").encode())  # unbuffered: nothing is flushed after os._exit
    os._exit(PEER_LOST_EXIT_CODE)


def store_address(store: Any) -> str:
    """``host:port`` of the TCPStore under ``store`` (PrefixStores unwrapped), or a description."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    return f"{host}:{port}" if host is not None else type(store).__name__


class PeerWatchdog:
    """Heartbeats of this rank through ``store``; ends the process when a peer or the store falls silent.

    Args:
        store: the job's key-value store (the default process group's); a connection of its own is cloned from it.
        rank, world_size: this rank and the number of ranks.
        node_of: the node of a rank, for messages.
        timeout: seconds of silence after which a peer (or the store) is lost.
        interval: seconds between beats.
        checkpoint: returns the last checkpoint this run committed (named in the message), or None.
        on_lost: called with the message; default :func:`exit_lost`. Tests pass their own.
        clock: the monotonic clock (tests pass their own).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        node_of: Callable[[int], int],
        timeout: float = DEFAULT_TIMEOUT_S,
        interval: float = DEFAULT_INTERVAL_S,
        checkpoint: Callable[[], Optional[str]] = lambda: None,
        on_lost: Callable[[str], None] = exit_lost,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_settings(timeout, interval)
        self.store = store
        self.rank = rank
        self.node_of = node_of
        self.interval = interval
        self.call_timeout = min(2 * interval, _MAX_CALL_TIMEOUT_S)
        self.checkpoint = checkpoint
        self.on_lost = on_lost
        self.clock = clock
        self.address = store_address(store)
        self.book = BeatBook(rank, world_size, timeout, started=clock())
        self.verdict: Optional[str] = None
        self._client: Optional[Any] = None
        self._lock = threading.Lock()  # the book is written by the beat thread and read by the judge
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._identity = f"{node_of(rank)}:{socket.gethostname()}"
        self._last_progress: Optional[float] = None

    def note_progress(self) -> None:
        """Called by the strategy after work that needed every rank (a training or evaluation step, an optimizer
        step): evidence of life that counts like a beat from every peer (see ``BeatBook.credit_progress``)."""
        self._last_progress = self.clock()

    @property
    def slowest_round_trip(self) -> float:
        """The longest successful beat-and-read round trip so far, in seconds (what the timeout must exceed)."""
        return self.book.slowest_round_trip

    def start(self) -> PeerWatchdog:
        self._threads = [
            threading.Thread(target=self._beat_loop, name="lightning-hpz-heartbeat", daemon=True),
            threading.Thread(target=self._judge_loop, name="lightning-hpz-peer-judge", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        atexit.register(self.stop)  # a Fabric script may never call teardown: its peers must not take it for lost
        return self

    def stop(self) -> None:
        """Stop both threads and mark this rank as having left (peers finishing later do not take it for lost)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        atexit.unregister(self.stop)
        for thread in self._threads:
            # the beat thread may be inside one store call: it gives up after the call's timeout
            thread.join(timeout=self.call_timeout + 1.0)
        self._mark_left()
        if self.rank == 0 and self.verdict is None:
            self._wait_for_peers_to_leave()

    def _wait_for_peers_to_leave(self) -> None:
        """Rank 0's process serves the store under Lightning's launchers: its exit takes the store away, and a peer
        still finishing (reaching the same error later on a loaded machine, a longer teardown) would take that for
        rank 0's node being lost and end with 76. So rank 0 waits until every peer has left, or has been silent for
        three intervals (gone already), at most ``timeout`` seconds. Live peers leave within their teardown."""
        deadline, last_seen, poll = self.clock() + self.book.timeout, {}, min(0.2, self.interval / 4)
        keys = {peer: heartbeat_key(peer) for peer in self.book.peers}
        while self.clock() < deadline:
            try:
                client = self._connection()
                values = {peer: _text(client.get(key)) if client.check([key]) else None for peer, key in keys.items()}
            except Exception:  # the store is gone already: nobody can be told anything
                return
            now = self.clock()
            for peer, value in values.items():
                if last_seen.get(peer, (None,))[0] != value:
                    last_seen[peer] = (value, now)
            if all(value in (None, LEFT) or now - last_seen[p][1] > 3 * self.interval for p, value in values.items()):
                return
            time.sleep(poll)

    def confirm_peers_alive(self) -> bool:
        """Wait until every peer has beaten since this call (or left): True. A peer that stays silent is declared
        lost by the judge first (which, by default, ends the process); False only if that did not end it.

        For a rank whose collective just failed: "connection closed by peer" from gloo may mean a crashed peer,
        which is handled as any exception, or a node that is gone, which is a lost peer. A live peer is seen to beat
        twice within about two intervals, so an ordinary error is delayed by that much at most.
        """
        with self._lock:
            seen = dict(self.book.changes)
        deadline = self.clock() + self.book.timeout + 2 * self.interval + self.call_timeout
        while not self._stopping.is_set() and self.clock() < deadline and self.verdict is None:
            with self._lock:
                book = self.book
                # two changes: the first may be a beat written before the failure and read only after it
                if all(peer in book.left or book.changes[peer] >= seen[peer] + 2 for peer in book.peers):
                    return True
            self._stopping.wait(min(0.2, self.interval / 4))
        return False

    # ------------------------------------------------------------------------------------------------ beat thread
    def _beat_loop(self) -> None:
        while not self._stopping.is_set():
            started = self.clock()
            try:
                values = self._beat_and_read()
            except Exception as err:  # unreachable, timed out, reset: the judge decides when that is too long
                log.debug("rank %d: heartbeat through the store at %s failed: %s", self.rank, self.address, err)
                self._client = None  # a timed-out connection may hold a late reply: open a fresh one next time
            else:
                answered = self.clock()
                with self._lock:
                    self.book.observe(values, answered, answered - started)
            self._stopping.wait(self.interval)

    def _connection(self) -> Any:
        if self._client is None:
            client = self.store.clone()  # connects with the store's timeout, then gets the short one
            client.set_timeout(datetime.timedelta(seconds=self.call_timeout))
            self._client = client
        return self._client

    def _beat_and_read(self) -> dict[int, Optional[str]]:
        client = self._connection()
        client.set(heartbeat_key(self.rank), f"{time.monotonic_ns()} {self._identity}")
        peers = self.book.peers
        keys = [heartbeat_key(peer) for peer in peers]
        if client.check(keys):
            return {peer: _text(value) for peer, value in zip(peers, client.multi_get(keys), strict=True)}
        # before every peer has beaten once (set-up): read those that exist, one by one
        return {peer: _text(client.get(key)) if client.check([key]) else None for peer, key in zip(peers, keys)}  # noqa: B905

    def _mark_left(self) -> None:
        if any(thread.is_alive() for thread in self._threads):
            return  # the beat thread is stuck in a call on the connection: the store is unreachable anyway
        try:
            self._connection().set(heartbeat_key(self.rank), LEFT)
        except Exception as err:  # the store is gone: peers will find out themselves
            log.debug("rank %d could not mark that it left: %s", self.rank, err)
        self._client = None

    # ----------------------------------------------------------------------------------------------- judge thread
    def _judge_loop(self) -> None:
        tick = min(1.0, self.interval / 2)
        previous = self.clock()
        while not self._stopping.wait(tick):
            now = self.clock()
            if self._judge(now, late_by=now - previous - tick):
                return
            previous = now

    def _judge(self, now: float, late_by: float = 0.0) -> bool:
        """One look at the book; True when the run was declared lost (``on_lost`` called)."""
        with self._lock:
            if late_by > self.book.timeout / 3:
                self.book.excuse(late_by)
            self.book.credit_progress(self._last_progress)
            verdict = describe_loss(self.book, now, self.node_of, self.address, self.checkpoint())
        if verdict is None or self._stopping.is_set():
            return False
        self.verdict = verdict
        self.on_lost(verdict)
        return True


def _text(value: Any) -> Optional[str]:
    return value.decode() if isinstance(value, bytes) else value
