"""The peer watchdog's decisions without a cluster: a fake store and a fake clock (lifecycle/peer_watchdog.py).

A peer that stops beating is lost after the timeout, one that keeps beating never is however slow, a rank that left
cleanly is not missed, an unreachable store is named, a store that stalls for less than the timeout kills nothing,
a loss found by a node's leader reaches every rank through rank 0, and this process's own stall is not blamed on its
peers. Each rank reads O(1) keys (a leader its node's, rank 0 its node's and the leaders').
"""

from __future__ import annotations

import sys
import threading
import time

import pytest

from lightning_hpz.lifecycle import peer_watchdog
from lightning_hpz.lifecycle.peer_watchdog import LEFT, Beat, BeatBook, PeerWatchdog, Tree, describe_loss, heartbeat_key
from lightning_hpz.lifecycle.run_exit import PEER_LOST_EXIT_CODE


def node_of(rank: int) -> int:
    return rank // 2


@pytest.fixture(autouse=True)
def _first_run_of_each_rank():
    # keys are per run of a rank in its process (a second fit gets fresh ones): each test here is a first run
    peer_watchdog._runs_started.clear()


def _book(rank: int, world_size: int, started: float = 0.0, nodes=node_of) -> tuple[BeatBook, Tree]:
    tree = Tree(rank, world_size, nodes)
    return BeatBook(rank, tree.watched(), timeout=45, started=started), tree


def test_each_rank_reads_one_key_a_leader_its_node_and_rank_0_its_node_and_the_leaders():
    def eight_per_node(rank: int) -> int:
        return rank // 8

    assert Tree(5, 1024, eight_per_node).watched() == [0]
    assert Tree(8, 1024, eight_per_node).watched() == [0, *range(9, 16)]
    judge = Tree(0, 1024, eight_per_node).watched()
    assert judge == [*range(1, 8), *range(8, 1024, 8)] and len(judge) == 7 + 127
    assert Tree(0, 1024, eight_per_node).covered(16) == list(range(16, 24))  # a silent leader: its whole node


def test_a_leader_that_stops_beating_is_lost_after_the_timeout_and_named_with_its_node():
    book, tree = _book(rank=0, world_size=4)
    assert book.watched == [1, 2]  # rank 1 on its node, rank 2 leading node 1
    for now in range(5, 200, 5):
        book.observe({1: f"b{now}", 2: f"b{min(now, 20)}"}, now, 0.1)  # node 1 stops at 20 s
        message = describe_loss(book, float(now), tree, "10.0.0.1:29500", "/ckpt/step=8.ckpt")
        if message:
            break
    assert now == 70  # last change at 20 s, silent for over 45 s at the first look after 65 s
    assert "node 1 (ranks 2, 3) silent for 50 s" in message
    assert "rank 0 (node 0)" in message and f"exit code {PEER_LOST_EXIT_CODE}" in message
    assert "/ckpt/step=8.ckpt" in message


def test_a_loss_found_by_a_leader_reaches_every_rank_through_rank_0():
    leader, leader_tree = _book(rank=2, world_size=4)
    for now in range(5, 80, 5):
        leader.observe({0: f"b{now}", 3: f"b{min(now, 20)}"}, float(now), 0.1)  # rank 3 dies, its node lives
    found = peer_watchdog.what_is_lost(leader, 75.0, leader_tree, "store")
    assert found.startswith("node 1 (ranks 3) silent")
    judge, judge_tree = _book(rank=0, world_size=4)
    judge.observe({1: "b", 2: Beat.format("1:host", 3.0, found)}, 80.0, 0.1)
    relayed = peer_watchdog.what_is_lost(judge, 80.0, judge_tree, "store")
    assert relayed == f"{found} (found by rank 2)"
    other, other_tree = _book(rank=1, world_size=4)
    other.observe({0: Beat.format("0:host", 5.0, relayed)}, 85.0, 0.1)
    assert f"rank 1 (node 0) ends the run with exit code {PEER_LOST_EXIT_CODE}: {relayed}" in describe_loss(
        other, 85.0, other_tree, "store", None
    )


def test_a_slow_peer_that_keeps_beating_is_never_lost():
    book, tree = _book(rank=1, world_size=2)
    for now in range(30, 3000, 30):  # a beat seen only every 30 s (slow link, long step): still alive
        book.observe({0: f"beat {now}"}, float(now), round_trip=25.0)
        assert describe_loss(book, now + 14.0, tree, "store", None) is None
    assert book.slowest_round_trip == 25.0


def test_a_store_stall_shorter_than_the_timeout_kills_nothing():
    book, tree = _book(rank=0, world_size=2)
    for now in (5.0, 10.0):
        book.observe({1: f"b{now}"}, now, 0.1)
    # the store answers nobody for 44 s: the peer's beats cannot land either; it beats again a beat after it is back
    book.observe({1: "b10.0"}, 54.0, 0.1)
    book.observe({1: "b10.0"}, 59.0, 0.1)
    assert describe_loss(book, 59.0, tree, "store", None) is None
    book.observe({1: "b60"}, 64.0, 0.1)
    assert describe_loss(book, 64.0, tree, "store", None) is None


def test_a_rank_that_left_cleanly_is_not_missed():
    book, tree = _book(rank=0, world_size=2)
    for now in range(5, 500, 5):  # the store still answers; the peer's key still says it left
        book.observe({1: LEFT}, float(now), 0.1)
    assert describe_loss(book, 500.0, tree, "store", None) is None


def test_a_peer_that_never_beats_is_lost_after_the_timeout_from_start():
    book, tree = _book(rank=0, world_size=2, started=100.0)
    for now in range(105, 145, 5):
        book.observe({1: None}, float(now), 0.1)
    assert describe_loss(book, 144.0, tree, "store", None) is None
    book.observe({1: None}, 146.0, 0.1)
    assert "node 0 (ranks 1)" in describe_loss(book, 146.0, tree, "store", None)


def test_an_unreachable_store_names_rank_0s_node_and_the_address():
    book, tree = _book(rank=2, world_size=4)
    book.observe({0: "a", 3: "a"}, 10.0, 0.1)
    message = describe_loss(book, 56.0, tree, "10.77.0.1:29500", None)
    assert "rendezvous store at 10.77.0.1:29500" in message and "rank 0's node, node 0" in message
    assert "no checkpoint committed" in message


def test_this_processs_own_stall_is_excused():
    book, tree = _book(rank=0, world_size=2)
    book.observe({1: "a"}, 10.0, 0.1)
    book.excuse(60.0)  # SIGSTOP for a minute: the peer could not be heard, through no fault of its own
    assert describe_loss(book, 75.0, tree, "store", None) is None


def test_steps_that_needed_every_peer_count_as_their_beats():
    # a slow link full of collectives can starve the beats' connection (seen once in CI at 2 Mbit/s) while training
    # goes on: each completed step proves every peer and the link alive
    book, tree = _book(rank=1, world_size=2)
    book.observe({0: "a"}, 5.0, 0.1)  # then neither the store nor the peer is heard again
    for step_done in (20.0, 40.0, 60.0):
        book.credit_progress(step_done)
        assert describe_loss(book, step_done + 30.0, tree, "store", None) is None
    assert "rendezvous store" in describe_loss(book, 106.0, tree, "store", None)  # steps stopped at 60 s


def test_keys_vouch_for_the_ranks_below_them_only():
    judge, _ = _book(rank=0, world_size=4)  # watches rank 1 (its node) and rank 2 (node 1's leader)
    judge.observe({1: "1 0 0:h", 2: "1 0 1:h"}, 5.0, 0.1)
    judge.observe({1: "1 0 0:h", 2: "2 4 1:h"}, 10.0, 0.1)  # rank 2 wrote after 5 s that rank 3 beat 4 s before
    assert not judge.all_beat_since(0.5) and judge.vouched_since(10.0) == 10.0  # rank 1: nothing new since 0 s
    judge.observe({1: "2 0 0:h", 2: "3 4 1:h"}, 15.0, 0.1)
    assert judge.all_beat_since(5.5) and not judge.all_beat_since(6.5)  # rank 3 beat after 10 - 4 s
    assert judge.vouched_since(15.0) == 9.0
    leader, _ = _book(rank=2, world_size=4)
    leader.observe({0: "1 99 0:h", 3: "1 0 1:h"}, 5.0, 0.1)
    assert leader.vouched_since(5.0) == 5.0  # rank 3 only: rank 0's 99 s are not this key's to vouch for


@pytest.mark.parametrize(("timeout", "interval"), [(10, 5), (45, 0)])
def test_settings_that_would_take_a_live_peer_for_lost_are_refused(timeout, interval):
    with pytest.raises(ValueError, match=r"peer_timeout|heartbeat_interval"):
        peer_watchdog.check_settings(timeout, interval)


class FakeStore:
    """The few TCPStore calls the watchdog makes, in memory; ``reachable=False`` makes every call fail."""

    def __init__(self, data: dict | None = None) -> None:
        self.data = data if data is not None else {}
        self.reachable = True
        self.timeouts = []

    def clone(self):
        self._raise_if_unreachable()
        return FakeStore(self.data)  # a second connection to the same server

    def set_timeout(self, timeout) -> None:
        self.timeouts.append(timeout.total_seconds())

    def set(self, key, value) -> None:
        self._raise_if_unreachable()
        self.data[key] = value.encode()

    def add(self, key, amount) -> int:
        self._raise_if_unreachable()
        self.data[key] = str(int(self.data.get(key, b"0")) + amount).encode()
        return int(self.data[key])

    def check(self, keys) -> bool:
        self._raise_if_unreachable()
        return all(key in self.data for key in keys)

    def get(self, key):
        self._raise_if_unreachable()
        return self.data[key]

    def multi_get(self, keys):
        return [self.get(key) for key in keys]

    def _raise_if_unreachable(self) -> None:
        if not FakeStore.everything_reachable:
            raise RuntimeError("DistNetworkError: timed out")

    everything_reachable = True


def _watchdog(store: FakeStore, lost: list, rank: int = 0) -> PeerWatchdog:
    return PeerWatchdog(store, rank, 2, node_of, timeout=0.6, interval=0.1, on_lost=lost.append)


def test_threads_beat_detect_a_silent_peer_and_stop_cleanly():
    store, lost = FakeStore(), []
    watchdog = _watchdog(store, lost).start()
    for _ in range(5):  # the peer beats for a while
        store.data[heartbeat_key(1)] = str(time.monotonic()).encode()
        time.sleep(0.1)
    assert heartbeat_key(0) in store.data and not lost
    deadline = time.monotonic() + 5
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    watchdog.stop()
    assert lost and "node 0 (ranks 1) silent" in lost[0]
    assert store.data[heartbeat_key(0)] == LEFT.encode()
    assert not [t for t in threading.enumerate() if t.name.startswith("lightning-hpz-")]


def test_threads_name_the_store_when_it_stops_answering():
    store, lost = FakeStore(), []
    store.data[heartbeat_key(1)] = b"x"
    watchdog = _watchdog(store, lost).start()
    try:
        time.sleep(0.3)
        FakeStore.everything_reachable = False
        deadline = time.monotonic() + 5
        while not lost and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        FakeStore.everything_reachable = True
        watchdog.stop()
    assert lost and "rendezvous store" in lost[0]


def test_a_peer_beating_through_its_own_watchdog_keeps_both_alive():
    store, lost = FakeStore(), []
    pair = [_watchdog(store, lost, rank=0).start(), _watchdog(store, lost, rank=1).start()]
    time.sleep(1.5)  # over twice the timeout
    pair[0].stop()
    time.sleep(1.0)  # rank 0 left cleanly: rank 1 finishing later does not take it for lost
    pair[1].stop()
    assert lost == []
    assert pair[1].slowest_round_trip < 0.6


def test_after_a_failed_collective_live_peers_are_confirmed_and_silent_ones_declared():
    store, lost = FakeStore(), []
    pair = [_watchdog(store, lost, rank=0).start(), _watchdog(store, lost, rank=1).start()]
    try:
        started = time.monotonic()
        assert pair[0].confirm_peers_alive()  # rank 1 beats: an ordinary error, handled as such
        assert time.monotonic() - started < 0.6 and lost == []  # two beats of 0.1 s
        pair[1]._stopping.set()  # rank 1's node is gone: no beat, no "left"
        for thread in pair[1]._threads:
            thread.join()
        assert not pair[0].confirm_peers_alive()
        assert lost and "node 0 (ranks 1) silent" in lost[0]
    finally:
        for watchdog in pair:
            watchdog.stop()


def test_both_strategies_take_the_settings_and_refuse_bad_ones_at_construction():
    from lightning_hpz import HpzFabricStrategy, HpzStrategy

    assert HpzStrategy().peer_timeout == peer_watchdog.DEFAULT_TIMEOUT_S
    assert HpzFabricStrategy(peer_timeout=None).peer_timeout is None  # off
    assert HpzStrategy(peer_timeout=90, heartbeat_interval=10).heartbeat_interval == 10
    with pytest.raises(ValueError, match="three heartbeat intervals"):
        HpzFabricStrategy(peer_timeout=10, heartbeat_interval=5)


def test_rank_0_keeps_the_store_up_until_a_slower_peer_has_left():
    """Under Lightning's launchers rank 0 serves the store: leaving before a slower peer finishes would make that
    peer take the store's end for a lost node (seen in CI: exit 76 after both ranks raised the same error)."""
    store, lost = FakeStore(), []
    pair = [_watchdog(store, lost, rank=0).start(), _watchdog(store, lost, rank=1).start()]
    time.sleep(0.3)
    slower = threading.Timer(0.4, pair[1].stop)  # rank 1 reaches its teardown 0.4 s after rank 0
    slower.start()
    started = time.monotonic()
    pair[0].stop()
    waited = time.monotonic() - started
    slower.join()
    assert 0.3 < waited < 0.6 + 0.5, waited  # until rank 1 left, not the whole timeout (0.6 s)
    assert store.data[heartbeat_key(1)] == LEFT.encode() and lost == []


def test_rank_0_does_not_wait_for_a_peer_that_is_gone():
    store, lost = FakeStore(), []
    store.data[heartbeat_key(1)] = b"beat before the node was lost"
    watchdog = _watchdog(store, lost, rank=0)
    watchdog._stopping.set()  # stopped before its threads ran: only the leaving part is timed
    started = time.monotonic()
    watchdog._stopping.clear()
    watchdog.stop()
    assert time.monotonic() - started < 0.6  # silent for three intervals (0.3 s): gone, not waited for


@pytest.mark.parametrize("environment", ["lightning", "torchelastic"])
@pytest.mark.parametrize("local_rank", [0, 1])
def test_only_a_child_of_lightnings_launcher_leaves_the_lost_code_to_its_launching_process(
    environment, local_rank, monkeypatch
):
    # Lightning's child observer SIGKILLs the node when a child exits non-zero: the child exits 0, the launching
    # process (local rank 0) 76; under torchrun, SLURM and the like every rank carries 76 itself
    from lightning.fabric.plugins.environments import LightningEnvironment, TorchElasticEnvironment

    from lightning_hpz.lifecycle.run_exit import started_by_lightning_launcher

    class Strategy:
        cluster_environment = LightningEnvironment() if environment == "lightning" else TorchElasticEnvironment()

    Strategy.local_rank = local_rank
    expected = environment == "lightning" and local_rank > 0
    assert started_by_lightning_launcher(Strategy()) is expected
    codes = []
    monkeypatch.setattr(peer_watchdog.os, "_exit", codes.append)
    peer_watchdog.exit_lost("lost", code=0 if expected else PEER_LOST_EXIT_CODE)
    assert codes == [0 if expected else PEER_LOST_EXIT_CODE]


class OneLostRequest(FakeStore):
    """Rank 1's connection loses one request (a packet dropped, again and again, on a saturated link): the call waits
    its whole timeout and fails; the connection opened after it works."""

    def __init__(self, data: dict | None = None, pending: dict | None = None) -> None:
        super().__init__(data)
        self.pending = pending if pending is not None else {"lose": False}
        self.call_timeout = 0.0

    def clone(self):
        return OneLostRequest(self.data, self.pending)

    def set_timeout(self, timeout) -> None:
        self.call_timeout = timeout.total_seconds()

    def set(self, key, value) -> None:
        if key == heartbeat_key(1) and self.pending["lose"]:
            self.pending["lose"] = False
            time.sleep(self.call_timeout)
            raise RuntimeError("DistNetworkError: timed out")
        super().set(key, value)


def test_one_request_lost_at_the_shortest_timeout_allowed_ends_nothing():
    """At ``timeout = 3 * interval`` a call that times out is retried at once: the store answers again within two
    call timeouts of an interval's wait. Waiting the interval after a call that timed out 2 intervals ends the run."""
    assert peer_watchdog.call_timeout(45.0, 5.0) == 10.0  # the defaults: unchanged
    assert peer_watchdog.call_timeout(15.0, 5.0) == 5.0
    store, lost = OneLostRequest(), []
    pair = [PeerWatchdog(store, r, 2, node_of, timeout=3.0, interval=1.0, on_lost=lost.append) for r in (0, 1)]
    for watchdog in pair:
        watchdog.start()
    try:
        time.sleep(1.5)
        store.pending["lose"] = True
        time.sleep(5.0)
    finally:
        for watchdog in pair:
            watchdog.stop()
    assert lost == [] and pair[1].failed_calls == 1 and not store.pending["lose"]


def test_a_trainer_step_counts_its_forward_backward_and_optimizer_step_as_progress(tmp_path):
    """A step slowed by a starved link still credits the watchdog three times: each part needed every peer."""
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hpz import HpzStrategy

    class Credits:
        notes: list[str] = []
        slowest_round_trip = 0.0

        def note_progress(self) -> None:
            self.notes.append(sys._getframe(2).f_code.co_name)  # the strategy method that noted it

        def stop(self) -> None:
            pass

    class Install(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            trainer.strategy.peer_watchdog = Credits()

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 4)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(
        strategy=HpzStrategy(stage=3),
        accelerator="cpu",
        devices=1,
        max_steps=2,
        callbacks=[Install()],
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2))
    assert Credits.notes == ["training_step", "backward", "optimizer_step"] * 2


def test_stop_ends_the_beat_thread_while_the_store_is_gone(tmp_path):
    """A store gone at teardown (rank 0's process died first) leaves the beat thread reconnecting: every store call
    of it, connecting included, gives up within the join that ``stop`` waits, so no thread outlives the run."""
    import datetime
    import subprocess

    from torch.distributed import TCPStore

    ready = tmp_path / "port"
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import datetime, sys, time; from torch.distributed import TCPStore; "
            "s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, "
            "timeout=datetime.timedelta(seconds=60)); "
            f"open({str(ready)!r}, 'w').write(str(s.port)); time.sleep(120)",
        ]
    )
    try:
        deadline = time.monotonic() + 60
        while not (ready.exists() and ready.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        store = TCPStore("127.0.0.1", int(ready.read_text()), is_master=False, timeout=datetime.timedelta(seconds=30))
        lost = []
        watchdog = PeerWatchdog(store, 1, 2, node_of, timeout=9.0, interval=1.0, on_lost=lost.append).start()
        time.sleep(1.5)
        assert watchdog.beats >= 1
    finally:
        server.kill()
        server.wait()
    time.sleep(1.5)  # the beat's call fails at once; it reconnects to a port nobody listens on
    started = time.monotonic()
    watchdog.stop()
    assert time.monotonic() - started < 1.5  # TCPStore's own connect retries a refused port for over 2 call timeouts
    assert watchdog.failed_calls >= 1
    assert not [thread for thread in watchdog._threads if thread.is_alive()]
