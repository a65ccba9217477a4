"""The rendezvous store's load from the peer watchdog at up to 1,024 ranks, against a real ``TCPStore`` here.

    python benchmarks/store_load.py --ranks 64 256 1024 --per-node 8 --old

Each simulated rank is a :class:`~lightning_hpz.lifecycle.peer_watchdog.PeerWatchdog` whose threads are not started:
one interval is every rank's ``_beat_and_read`` (exactly the requests its beat thread sends each interval), issued
over a few client connections in parallel against a ``TCPStore`` server (torch's, one thread) that does nothing
else. The server's busy time per interval is bounded by the wall time from an interval's first request to its last
reply; the busy fraction is that over the default 5 s interval. Printed per world size: requests, keys read and
bytes per interval (all ranks, and the most at one rank), the busy time and fraction. ``--old`` replays the
previous design too (every rank: a ``set``, a ``check`` and a ``multi_get`` of all N-1 peer keys). ``--json`` prints
the rows as JSON (tests/test_store_load.py reads it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch.distributed import TCPStore

from lightning_hpz.lifecycle import peer_watchdog
from lightning_hpz.lifecycle.peer_watchdog import PeerWatchdog, heartbeat_key


class CountingClient:
    """A store connection that counts the requests, key reads and bytes sent through it."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.requests = self.keys_read = self.bytes = 0

    def _count(self, keys: list[str], payload: int = 0) -> None:
        self.requests += 1
        self.bytes += sum(len(key) for key in keys) + payload

    def set(self, key: str, value: str) -> None:
        self._count([key], len(value))
        self.store.set(key, value)

    def check(self, keys: list[str]) -> bool:
        self._count(keys)
        self.keys_read += len(keys)
        return self.store.check(keys)

    def get(self, key: str) -> bytes:
        self._count([key])
        self.keys_read += 1
        value = self.store.get(key)
        self.bytes += len(value)
        return value

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._count(keys)
        self.keys_read += len(keys)
        values = self.store.multi_get(keys)
        self.bytes += sum(len(value) for value in values)
        return values


def old_design_beat(client: CountingClient, rank: int, world_size: int) -> None:
    """The requests one rank sent per interval before the tree: its key, then every peer's."""
    client.set(heartbeat_key(rank, 99), f"{time.monotonic_ns()} 0:host")
    keys = [heartbeat_key(peer, 99) for peer in range(world_size) if peer != rank]
    if client.check(keys):
        client.multi_get(keys)


def simulate(world_size: int, per_node: int, clients: int, intervals: int, old: bool, port: int) -> dict:
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(60))
    connections = [
        CountingClient(TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(60)))
        for _ in range(clients)
    ]
    peer_watchdog._runs_started.clear()
    watchdogs = [PeerWatchdog(server, rank, world_size, lambda r: r // per_node) for rank in range(world_size)]
    for index, watchdog in enumerate(watchdogs):
        watchdog._client = connections[index % clients]

    def one_interval() -> tuple[float, list[dict]]:
        before = [vars(c).copy() for c in connections]

        def beat_share(index: int) -> None:
            for rank in range(index, world_size, clients):
                if old:
                    old_design_beat(connections[index], rank, world_size)
                else:
                    watchdogs[rank]._beat_and_read()

        threads = [threading.Thread(target=beat_share, args=(i,)) for i in range(clients)]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        busy = time.perf_counter() - started
        counts = [
            {k: vars(c)[k] - b[k] for k in ("requests", "keys_read", "bytes")}
            for c, b in zip(connections, before, strict=True)
        ]
        return busy, counts

    one_interval()  # set-up: every key written once (and, in the new design, every watched key found to exist)
    if not old:
        for watchdog in watchdogs:
            watchdog._keys_exist = True  # what the set-up interval established on each rank
    busy_times, counts = [], []
    for _ in range(intervals):
        busy, counted = one_interval()
        busy_times.append(busy)
        counts = counted
    most_keys = max(len(w.watched) for w in watchdogs) if not old else world_size - 1
    total = {k: sum(c[k] for c in counts) for k in ("requests", "keys_read", "bytes")}
    interval = peer_watchdog.DEFAULT_INTERVAL_S
    return {
        "design": "old" if old else "tree",
        "ranks": world_size,
        "nodes": -(-world_size // per_node),
        "requests": total["requests"],
        "keys_read": total["keys_read"],
        "bytes": total["bytes"],
        "most_keys_at_one_rank": most_keys,
        "busy_s_median": statistics.median(busy_times),
        "busy_s_max": max(busy_times),
        "busy_fraction_max": max(busy_times) / interval,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--clients", type=int, default=8, help="client connections the simulated ranks share")
    parser.add_argument("--intervals", type=int, default=5)
    parser.add_argument("--old", action="store_true", help="also replay the previous all-to-all design")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    rows = []
    for ranks in args.ranks:
        for old in [False, True] if args.old else [False]:
            rows.append(simulate(ranks, args.per_node, args.clients, args.intervals, old, args.port))
    if args.json:
        print(json.dumps(rows))
        return
    print("| design | ranks | nodes | requests/interval | keys read/interval | bytes/interval | most keys at one rank "
          "| busy s (median, max) | busy fraction of 5 s (max) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['design']} | {row['ranks']} | {row['nodes']} | {row['requests']} | {row['keys_read']} | "
            f"{row['bytes']} | {row['most_keys_at_one_rank']} | {row['busy_s_median']:.3f}, {row['busy_s_max']:.3f} "
            f"| {100 * row['busy_fraction_max']:.2f}% |"
        )


if __name__ == "__main__":
    main()
