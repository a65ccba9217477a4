"""A lost node or a cut link ends the run in about a minute, with exit code 76 and a message naming who is gone.

Without this, the ranks that survive a node's loss (power, kernel panic, every rank OOM-killed) or a cut inter-node
link wait in their collective until the process-group timeout, 30 minutes by default; under NCCL even a failing
rank's abort does not wake the ranks of other nodes. Design, with the reasons:

- **Heartbeats through the job's rendezvous store, read along a tree.** Every rank writes its own key
  ``lightning_hpz/heartbeat/<run>/<rank>`` every ``interval`` seconds and reads, in one ``multi_get``, only the keys
  it watches: a rank reads rank 0's key; a node's leader (its lowest rank) also reads its own node's ranks; rank 0
  (the *judge*) reads its node's ranks and the other nodes' leaders. Each key carries how long ago, at most, every
  rank its writer watches last beat, so rank 0's key vouches for the whole job and a leader's for its node. Cost per
  interval: two requests per rank (a ``set`` and a ``multi_get``); one key read per rank, ``devices per node`` per
  leader and ``nodes + devices per node`` at rank 0, so the store serves ``2N`` requests and about ``2N + M`` key
  reads per interval for ``N`` ranks on ``M`` nodes (``docs/scale.md``). No rank reads every key on a schedule.
- **A loss travels up, the verdict down.** A leader that finds one of its node's ranks silent writes ``lost`` with
  the names into its key; rank 0 finds a leader silent (the node is gone or cut off) or reporting a loss, and writes
  the verdict into its own key, which every rank reads. Rank 0 and the leaders keep their key up for two more
  intervals before they exit, so the verdict reaches every rank; a rank that finds rank 0 silent (or the store
  unreachable) ends at once.
- **The store is the one the default process group was built on** (Lightning's ``MASTER_ADDR:MASTER_PORT`` TCPStore,
  or torchrun's): it exists in every launch, needs no port or group of its own, and carries no bulk traffic. A gloo
  side group with a short timeout would instead need a collective every rank joins in step, which a rank blocked in a
  long NCCL kernel cannot do.
- **Store calls never block the decision.** The beat thread talks to the store over a connection of its own, so
  the training thread's store calls keep their own timeout; a call that hangs on a dead link only delays that
  thread, and each of its requests, connecting included, ends within the join ``stop`` waits for. The judge
  thread never touches the network: when no store call has succeeded for ``timeout`` seconds, the store itself is
  unreachable. One lost request is not that: a beat starts every ``interval``, each request gives up after
  ``interval * 2`` (at most 15 s, and at most half of what ``timeout`` leaves after an interval), and a beat whose
  request timed out is retried at once on a fresh connection, so it takes about two timed-out requests in a row to
  end the run (a slowed link that drops the one request of a beat, at ``timeout = 3 * interval``, would otherwise
  end it). The store is served from rank 0's node, so that is how rank 0's node's loss, or a cut link seen from the
  other nodes, shows: the message names the store's address and rank 0's node.
- **Lost after ``timeout`` seconds of silence, default 45 s.** On the two-node testbed with the link slowed 100-fold
  and full of ZeRO-3 all-gathers, heartbeat round trips stay far below it (docs/operations.md, "Lost nodes and cut
  links"). Silence is counted only while the store answers: a store that stalls
  for less than ``timeout`` (a busy rank 0, a brief network hiccup) delays everyone's beats alike and kills nothing.
  A peer that keeps beating is never declared lost, however slow its steps: the beats run beside training, so a
  long checkpoint save, the first step's compilation, or a slow link does not stop them (``torch.save`` releases the
  GIL). When this process itself was stopped (a judge tick late by over ``timeout / 3``, e.g. SIGSTOP, swap), peers
  get a fresh ``timeout``.
- **A rank that ends cleanly says so.** At teardown, at interpreter exit, or when the process group it was started
  with is destroyed (a Fabric script or LitGPT never calls teardown), a rank writes ``left`` into its key and counts
  itself in ``<run>/left``: a peer that finishes later does not take it for lost. Rank 0, whose process serves the
  store under Lightning's launchers, then waits until every live peer has left (it reads that one counter, and the
  peers' keys once an interval), so that a slower peer does not take the store's disappearance for a lost node.
  The threads are daemons with a ``stop`` method: no package thread outlives the script or the process group.
- **The exit is ``os._exit(76)``, from the judge thread.** A rank blocked inside a collective cannot be unblocked
  otherwise, and no collective may run on the way out (it would block the same way). 76 is sysexits' ``EX_PROTOCOL``
  ("remote error"): distinct from 0, 3, 4, 75 and a crash's 1 or signal codes. Before exiting the rank prints which
  ranks are silent on which node, or that the store is unreachable, and the last checkpoint committed by this run.
  A save in flight at that moment is abandoned in its staging folder: the commit is atomic, so the previous committed
  checkpoint stays the newest and intact.
- **A failed collective is explained before it is handled.** When a Trainer rank's collective raises (gloo's
  "Connection closed by peer" when a node's ranks were killed), the strategy first waits until the keys it watches
  vouch that every rank beat since the failure (:meth:`PeerWatchdog.confirm_peers_alive`, about three intervals for
  live peers) and only then runs the usual failure handling (``rank_failure.py``); peers that stay silent end the
  run with 76 and their names instead of a traceback about a socket.

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
_LOST = "lost"  # marks a key whose writer found ranks it watches silent; the description follows
_MAX_CALL_TIMEOUT_S = 15.0
_PREFIX = "lightning_hpz/heartbeat"
_runs_started: dict[int, int] = {}  # per rank: watchdogs started in this process (each run gets fresh keys)


def heartbeat_key(rank: int, run: int = 0) -> str:
    return f"{_PREFIX}/{run}/{rank}"


def left_count_key(run: int = 0) -> str:
    return f"{_PREFIX}/{run}/left"


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


def call_timeout(timeout: float, interval: float) -> float:
    """How long one store call of the beat thread may take: two calls in a row that time out, after an interval's
    wait, take at most ``timeout``."""
    return min(2 * interval, _MAX_CALL_TIMEOUT_S, (timeout - interval) / 2)


class Tree:
    """Whose key each rank reads: rank 0 judges the node leaders, a leader its node, every rank reads rank 0."""

    def __init__(self, rank: int, world_size: int, node_of: Callable[[int], int]) -> None:
        self.rank, self.world_size, self.node_of = rank, world_size, node_of
        self.nodes: dict[int, list[int]] = {}  # one pass over the ranks, at start only
        for peer in range(world_size):
            self.nodes.setdefault(node_of(peer), []).append(peer)
        self.node = node_of(rank)
        self.is_leader = rank == self.nodes[self.node][0]

    def watched(self) -> list[int]:
        """The ranks whose keys this rank reads each interval: O(1) for most ranks, O(devices per node) for a
        leader, O(nodes + devices per node) for rank 0."""
        own = [peer for peer in self.nodes[self.node] if peer != self.rank] if self.is_leader else []
        if self.rank != 0:
            return sorted({0, *own})
        return own + sorted(ranks[0] for node, ranks in self.nodes.items() if node != self.node)

    def covered(self, watched: int) -> list[int]:
        """The ranks a silent watched key stands for: a node leader's silence, seen by rank 0, is its node's."""
        node = self.node_of(watched)
        return self.nodes[node] if self.rank == 0 and node != self.node else [watched]


@dataclass
class Beat:
    """One value of a heartbeat key: a fresh stamp, how long ago at most every rank its writer watches beat, and the
    loss its writer found (or ``left``)."""

    vouched: float = 0.0
    lost: Optional[str] = None
    left: bool = False

    @staticmethod
    def parse(value: Optional[str]) -> Optional[Beat]:
        if value is None:
            return None
        if value == LEFT:
            return Beat(left=True)
        parts = value.split(" ", 4)
        lost = parts[4] if len(parts) == 5 and parts[3] == _LOST else None
        try:
            return Beat(vouched=float(parts[1]), lost=lost)
        except (IndexError, ValueError):
            return Beat()

    @staticmethod
    def format(identity: str, vouched: float, lost: Optional[str]) -> str:
        text = f"{time.monotonic_ns()} {vouched:.3f} {identity}"
        return f"{text} {_LOST} {lost}" if lost else text


@dataclass
class BeatBook:
    """What the judge thread knows: when each watched key last changed and when the store last answered (pure logic,
    every time passed in, so that it is tested without threads or a store)."""

    rank: int
    watched: list[int]
    timeout: float
    started: float
    interval: float = DEFAULT_INTERVAL_S
    last_change: dict[int, float] = field(default_factory=dict)
    values: dict[int, Optional[str]] = field(default_factory=dict)
    left: set[int] = field(default_factory=set)
    reported: dict[int, str] = field(default_factory=dict)  # losses found by the writers of watched keys
    written_after: dict[int, float] = field(default_factory=dict)  # the current value was written after this time
    vouched: dict[int, float] = field(default_factory=dict)
    last_read: dict[int, float] = field(default_factory=dict)
    last_store_answer: float = 0.0
    slowest_round_trip: float = 0.0

    def __post_init__(self) -> None:
        self.last_store_answer = self.started
        for peer in self.watched:
            self.last_change[peer] = self.last_read[peer] = self.started
            self.values[peer] = None

    def observe(self, values: dict[int, Optional[str]], now: float, round_trip: float) -> None:
        """Record one successful read of the watched keys (``None``: a key does not exist yet)."""
        stalled = now - self.last_store_answer - round_trip
        if stalled > 2 * self.interval:
            # the store did not answer anyone meanwhile: a writer's silence counts only while the store answers
            self._shift_changes(stalled - self.interval)
        self.last_store_answer = now
        self.slowest_round_trip = max(self.slowest_round_trip, round_trip)
        for peer, value in values.items():
            beat = Beat.parse(value)
            if value != self.values.get(peer):
                self.values[peer] = value
                self.last_change[peer] = now
                self.written_after[peer] = self.last_read.get(peer, self.started)
                self.vouched[peer] = beat.vouched if beat is not None else 0.0
            self.last_read[peer] = now
            if beat is not None and beat.left:
                self.left.add(peer)
            elif beat is not None:
                self.left.discard(peer)
            if beat is not None and beat.lost:
                self.reported[peer] = beat.lost

    def _shift_changes(self, seconds: float) -> None:
        for peer in self.last_change:
            self.last_change[peer] += seconds

    def excuse(self, stalled: float) -> None:
        """This process itself was stopped for ``stalled`` seconds: nobody else is to blame for that time."""
        self._shift_changes(stalled)
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
        """Watched keys read unchanged for longer than the timeout, with the seconds of silence.

        Counted up to the last read only: while the store does not answer, nobody's silence can be observed (the
        store's own silence decides then), so a cut link is reported as the store's, not as every peer's.
        """
        return {
            peer: self.last_store_answer - changed
            for peer, changed in self.last_change.items()
            if peer not in self.left and self.last_store_answer - changed > self.timeout
        }

    def vouched_since(self, now: float) -> float:
        """Seconds since which, at most, every rank under this rank's watch beat (what this rank's key vouches)."""
        oldest = now
        for peer in self.watched:
            if peer != 0 and peer not in self.left:  # rank 0's key is read from below: it vouches for nobody here
                oldest = min(oldest, self.written_after.get(peer, self.started) - self.vouched.get(peer, 0.0))
        return max(0.0, now - oldest)

    def all_beat_since(self, moment: float) -> bool:
        """Whether the watched keys vouch that every rank under them beat after ``moment`` (or left)."""
        return all(
            peer in self.left or self.written_after.get(peer, self.started) - self.vouched.get(peer, 0.0) > moment
            for peer in self.watched
        )


def what_is_lost(book: BeatBook, now: float, tree: Tree, store_address: str) -> Optional[str]:
    """What is gone, in words, or ``None`` while every watched key is fresh, reports no loss, and the store answers."""
    if book.store_silent_for(now) > book.timeout:
        return (
            f"the rendezvous store at {store_address} (served from rank 0's node, node {tree.node_of(0)}) has not "
            f"answered for {book.store_silent_for(now):.0f} s: rank 0's node is lost or the link to it is cut"
        )
    if book.reported:
        peer, found = min(book.reported.items())
        return found if peer == 0 else f"{found} (found by rank {peer})"
    return _silence(book.silent_peers(), tree)


def loss_message(rank: int, node: int, lost: str, timeout: float, checkpoint: Optional[str]) -> str:
    saved = (
        f"the last checkpoint this run committed is {checkpoint}: resume from it once every node is back"
        if checkpoint
        else "no checkpoint committed by this run"
    )
    return (
        f"lightning_hpz: rank {rank} (node {node}) ends the run with exit code {PEER_LOST_EXIT_CODE}: {lost} (no "
        f"heartbeat within peer_timeout={timeout:g} s). Not waiting for the process-group timeout; {saved}."
    )


def describe_loss(
    book: BeatBook, now: float, tree: Tree, store_address: str, checkpoint: Optional[str]
) -> Optional[str]:
    """The message to exit with, or ``None`` while nothing is lost."""
    lost = what_is_lost(book, now, tree, store_address)
    return None if lost is None else loss_message(book.rank, tree.node, lost, book.timeout, checkpoint)


def _silence(silent: dict[int, float], tree: Tree) -> Optional[str]:
    """Silent nodes and their ranks with the seconds of silence, or None if nobody is silent."""
    if not silent:
        return None
    by_node: dict[int, dict[int, float]] = {}
    for peer in sorted(silent):
        for rank in tree.covered(peer):
            by_node.setdefault(tree.node_of(rank), {})[rank] = silent[peer]
    described = "; ".join(
        f"node {node} (ranks {', '.join(map(str, ranks))}) silent for {max(ranks.values()):.0f} s"
        for node, ranks in sorted(by_node.items())
    )
    return described + ": lost, or the link to it is cut"


def exit_lost(message: str, code: int = PEER_LOST_EXIT_CODE) -> None:
    """Print ``message`` and end this process at once with ``code`` (no collective, no clean-up: the main thread may
    be blocked in a collective that will never complete). ``code`` is 0 on a rank whose launching process reports
    for the node (``run_exit.started_by_lightning_launcher``)."""
    if log.hasHandlers():  # a configured log file gets it too; stderr always does, below
        log.error(message)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    with contextlib.suppress(OSError):
        os.write(2, (message + "\n").encode())  # unbuffered: nothing is flushed after os._exit
    os._exit(code)


def store_address(store: Any) -> str:
    """``host:port`` of the TCPStore under ``store`` (PrefixStores unwrapped), or a description."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    return f"{host}:{port}" if host is not None else type(store).__name__


def connect(store: Any, call_timeout: float) -> Any:
    """A connection of its own to ``store``'s server, whose calls give up after ``call_timeout`` seconds. A
    ``clone`` would wait the store's own timeout, 30 minutes by default, for a server that may be gone; TCPStore's
    own connect retries a refused connection, with backoff, for up to about 2.7 times its timeout. So a plain socket
    first: a server that is gone fails at once, an unreachable host after ``call_timeout``, and the beat thread is
    never stuck connecting when ``stop`` joins it (a handshake slowed by a saturated link is retried at once)."""
    from torch.distributed import TCPStore

    base = store
    while hasattr(base, "underlying_store"):
        base = base.underlying_store
    patience = datetime.timedelta(seconds=call_timeout)
    if isinstance(base, TCPStore):
        socket.create_connection((base.host, base.port), timeout=call_timeout).close()
        client = TCPStore(base.host, base.port, is_master=False, timeout=patience, wait_for_workers=False)
    else:
        client = store.clone()
    client.set_timeout(patience)
    return client


class _WatchdogThread(threading.Thread):
    """A daemon thread of the watchdog that stops it on request: test harnesses that stop a finished test's daemon
    threads through their ``stop`` (Lightning's own) end the watchdog cleanly, peers told it left."""

    def __init__(self, watchdog: PeerWatchdog, target: Callable[[], None], name: str) -> None:
        super().__init__(target=target, name=name, daemon=True)
        self.stop = watchdog.stop


class PeerWatchdog:
    """Heartbeats of this rank through ``store``; ends the process when a peer or the store falls silent.

    Args:
        store: the job's key-value store (the default process group's); the watchdog opens a connection of its own.
        rank, world_size: this rank and the number of ranks.
        node_of: the node of a rank (ranks are numbered node by node), for the tree of reads and for messages.
        timeout: seconds of silence after which a peer (or the store) is lost.
        interval: seconds between beats.
        checkpoint: returns the last checkpoint this run committed (named in the message), or None.
        on_lost: called with the message; default :func:`exit_lost`. Tests pass their own.
        clock: the monotonic clock (tests pass their own).
        still_wanted: returns False once the run is over without a teardown (the process group it watches was
            destroyed): the watchdog then leaves quietly. Default: always wanted.
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
        still_wanted: Callable[[], bool] = lambda: True,
    ) -> None:
        check_settings(timeout, interval)
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.tree = Tree(rank, world_size, node_of)
        self.interval = interval
        self.call_timeout = call_timeout(timeout, interval)
        self.relay_s = 2 * interval + self.call_timeout  # how long a found loss stays published before the exit
        self.checkpoint = checkpoint
        self.on_lost = on_lost
        self.clock = clock
        self.still_wanted = still_wanted
        self.address = store_address(store)
        self.run = _runs_started.get(rank, 0)
        self.watched = self.tree.watched()
        self.relays = rank == 0 or self.tree.is_leader  # others learn of a loss through this rank's key
        self.book = BeatBook(rank, self.watched, timeout, started=clock(), interval=interval)
        self.verdict: Optional[str] = None
        self.found: Optional[str] = None  # the loss this rank publishes in its key
        self.store_requests = 0  # store calls made by the beat thread (the scale ledger counts them)
        self.beats = 0  # beats written and read back
        self.failed_calls = 0  # beats whose store call failed or timed out
        self._requests_in_flight = 0  # this beat's requests, counted into store_requests when it ends
        self._keys_exist = False
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
        _runs_started[self.rank] = self.run + 1
        self._threads = [
            _WatchdogThread(self, self._beat_loop, "lightning-hpz-heartbeat"),
            _WatchdogThread(self, self._judge_loop, "lightning-hpz-peer-judge"),
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
            if thread is not threading.current_thread():
                # the beat thread may be inside one store request or a connect to a server that answered the
                # probe (TCPStore's own retries there took up to 2.9 call timeouts); a store that is gone fails at
                # once (``connect``)
                thread.join(timeout=4 * self.call_timeout + 1.0)
        self._mark_left()
        if self.rank == 0 and self.verdict is None:
            self._wait_for_peers_to_leave()

    def _wait_for_peers_to_leave(self) -> None:
        """Rank 0's process serves the store under Lightning's launchers: its exit takes the store away, and a peer
        still finishing (reaching the same error later on a loaded machine, a longer teardown) would take that for
        rank 0's node being lost and end with 76. So rank 0 waits until every peer has left, or has been silent for
        three intervals (gone already), at most ``timeout`` seconds. It polls the count of ranks that left (one key)
        and reads the peers' keys once an interval: O(N) key reads per interval at rank 0, at the end of a run only."""
        deadline, poll = self.clock() + self.book.timeout, min(0.2, self.interval / 4)
        last_seen: dict[int, tuple[Optional[str], float]] = {}
        next_full_read = self.clock()
        peers = [peer for peer in range(self.world_size) if peer != self.rank]
        while self.clock() < deadline:
            try:
                client = self._connection()
                if int(client.add(left_count_key(self.run), 0)) >= self.world_size:  # rank 0 counted itself
                    return
                if self.clock() >= next_full_read:
                    next_full_read = self.clock() + self.interval
                    values = self._read(client, peers)
                    with self._lock:
                        self._count_requests()
                    now = self.clock()
                    for peer, value in values.items():
                        if last_seen.get(peer, (None,))[0] != value:
                            last_seen[peer] = (value, now)
                    gone = 3 * self.interval
                    if all(v in (None, LEFT) or now - last_seen[p][1] > gone for p, v in values.items()):
                        return
            except Exception:  # the store is gone already: nobody can be told anything
                return
            time.sleep(poll)

    def confirm_peers_alive(self) -> bool:
        """Wait until the keys this rank watches vouch that every rank beat since this call (or left): True. A rank
        that stays silent is declared lost first (which, by default, ends the process); False only if that did not
        end it.

        For a rank whose collective just failed: "connection closed by peer" from gloo may mean a crashed peer,
        which is handled as any exception, or a node that is gone, which is a lost peer. Live peers are vouched for
        within about three intervals (a beat, its leader's read, rank 0's read), so an ordinary error is delayed by
        that much at most.
        """
        called = self.clock()
        deadline = called + self.book.timeout + 4 * self.interval + self.call_timeout + self.relay_s
        while not self._stopping.is_set() and self.clock() < deadline and self.verdict is None:
            with self._lock:
                if self.book.all_beat_since(called):
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
                with self._lock:
                    self._count_requests()
                    self.failed_calls += 1
            else:
                answered = self.clock()
                with self._lock:
                    self.book.observe(values, answered, answered - started)
                    self._count_requests()
                    self.beats += 1
            # one beat per interval, counted from its start: a call that timed out is retried at once
            self._stopping.wait(max(0.0, self.interval - (self.clock() - started)))

    def _connection(self) -> Any:
        if self._client is None:
            self._client = connect(self.store, self.call_timeout)
        return self._client

    def _beat_and_read(self) -> dict[int, Optional[str]]:
        """One ``set`` of this rank's key and one ``multi_get`` of the watched keys (a ``check`` before it until
        every watched key exists: a ``multi_get`` of a missing key would wait for it)."""
        client = self._connection()
        with self._lock:
            vouched = self.book.vouched_since(self.clock())
        self._requests_in_flight += 1
        client.set(heartbeat_key(self.rank, self.run), Beat.format(self._identity, vouched, self.found))
        values = self._read(client, self.watched, self._keys_exist)
        self._keys_exist = all(value is not None for value in values.values())
        return values

    def _read(self, client: Any, ranks: list[int], all_exist: bool = False) -> dict[int, Optional[str]]:
        """The keys of ``ranks``: one ``multi_get``, after a ``check`` unless they are known to exist (a
        ``multi_get`` of a missing key would wait for it)."""
        keys = [heartbeat_key(rank, self.run) for rank in ranks]
        if not keys:
            return {}
        if not all_exist:
            self._requests_in_flight += 1
            if not client.check(keys):  # set-up: read those that exist, one by one, until every rank has beaten
                self._requests_in_flight += 2 * len(keys)
                return {rank: _text(client.get(key)) if client.check([key]) else None for rank, key in zip(ranks, keys)}  # noqa: B905
        self._requests_in_flight += 1
        return {rank: _text(value) for rank, value in zip(ranks, client.multi_get(keys), strict=True)}

    def _count_requests(self) -> None:
        # under the lock, with the beat's outcome: a ledger read between a beat's requests sees none of them
        self.store_requests += self._requests_in_flight
        self._requests_in_flight = 0

    def ledger(self) -> dict[str, int]:
        """Beats completed, beats failed and the store requests of both, read together (the scale ledger)."""
        with self._lock:
            return {"beats": self.beats, "failed_calls": self.failed_calls, "requests": self.store_requests}

    def _mark_left(self) -> None:
        if any(thread.is_alive() for thread in self._threads if thread is not threading.current_thread()):
            return  # the beat thread is stuck in a call on the connection: the store is unreachable anyway
        try:
            client = self._connection()
            client.set(heartbeat_key(self.rank, self.run), LEFT)
            client.add(left_count_key(self.run), 1)
        except Exception as err:  # the store is gone: peers will find out themselves
            log.debug("rank %d could not mark that it left: %s", self.rank, err)
        self._client = None

    # ----------------------------------------------------------------------------------------------- judge thread
    def _judge_loop(self) -> None:
        tick = min(1.0, self.interval / 2)
        previous = self.clock()
        while not self._stopping.wait(tick):
            if not self.still_wanted():
                self.stop()  # the process group this run used is gone (a script that never called teardown)
                return
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
            lost = what_is_lost(self.book, now, self.tree, self.address)
            # a loss rank 0 announced reached every rank already; with the store silent, nobody can be told
            tell_others = self.relays and 0 not in self.book.reported
            tell_others = tell_others and self.book.store_silent_for(now) <= self.book.timeout
        if lost is None or self._stopping.is_set():
            return False
        if tell_others:
            # rank 0 and node leaders carry a loss to the ranks that read them: their key says so for two more beats
            # before they exit (those readers are blocked in collectives: nothing else would tell them)
            self.found = lost
            self._stopping.wait(self.relay_s)
        self.verdict = loss_message(self.rank, self.tree.node, lost, self.book.timeout, self.checkpoint())
        self.on_lost(self.verdict)
        return True


def _text(value: Any) -> Optional[str]:
    return value.decode() if isinstance(value, bytes) else value
