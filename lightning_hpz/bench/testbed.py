"""A two-node cluster on one machine: two network namespaces joined by a rate-limited veth pair.

Each namespace is a "node": its processes talk to each other over the namespace's own loopback (fast, like NVLink or
shared memory), and to the other node only through the veth pair, whose egress is shaped with ``tc`` on both ends
(``tbf`` for the rate, ``netem`` for the latency where the kernel has it). The veth byte counters then measure exactly
the cross-node traffic. Everything built here is removed again by :meth:`TwoNodeTestbed.close`, which is idempotent
and also runs when building fails half-way.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

SUBNET_PREFIX = "10.77.0"  # exists only inside the testbed's own namespaces
NAMESPACE_PREFIX = "hpzbench-"
_OWNED_NAMESPACE = re.compile(rf"^{NAMESPACE_PREFIX}(\d+)-node[01]$")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$", re.IGNORECASE)
_TIME = re.compile(r"^(\d+(?:\.\d+)?)(us|ms|s)$", re.IGNORECASE)
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
QUEUE_SECONDS = 0.1  # the tbf queue holds this long a backlog before it drops


class TestbedUnavailableError(RuntimeError):
    """This machine cannot build the testbed (not root, no ``ip``/``tc``, no namespace support)."""


class TestbedError(RuntimeError):
    """A command that builds or reads the testbed failed; the message holds the command and its error."""


def parse_rate(text: str) -> float:
    """``"200mbit"`` -> 2e8 bits per second (tc's units)."""
    match = _RATE.match(text.strip())
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"bandwidth {text!r} is not a rate; write it as tc does, e.g. '200mbit' or '1gbit'.")
    return float(match.group(1)) * _RATE_UNITS[match.group(2).lower()]


def parse_delay(text: str) -> float:
    """``"1ms"`` -> 0.001 seconds; ``"0"`` is no added latency."""
    if text.strip() in ("0", "0ms", "0us", "0s"):
        return 0.0
    match = _TIME.match(text.strip())
    if not match:
        raise ValueError(f"latency {text!r} is not a time; write it as tc does, e.g. '1ms', '500us' or '0'.")
    return float(match.group(1)) * _TIME_UNITS[match.group(2).lower()]


def unavailable_reason() -> str | None:
    """Why the testbed cannot be built here, or ``None`` when it can. Builds nothing."""
    if os.name != "posix" or not Path("/proc/self/ns/net").exists():
        return "network namespaces need Linux (/proc/self/ns/net is missing)"
    if os.geteuid() != 0:
        return "creating network namespaces and veth pairs needs root (run as root, or in a privileged container)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found on PATH (install iproute2)"
    return None


@dataclass(frozen=True)
class LinkShape:
    """What the veth link between the two nodes is limited to, in each direction."""

    bandwidth: str = "200mbit"
    latency: str = "0ms"
    mtu: int = 9000

    def __post_init__(self) -> None:
        parse_rate(self.bandwidth)
        parse_delay(self.latency)
        if not 576 <= self.mtu <= 65535:
            raise ValueError(f"mtu={self.mtu} is outside 576..65535; 9000 (jumbo frames) or 1500 are usual.")

    @property
    def bits_per_second(self) -> float:
        return parse_rate(self.bandwidth)

    @property
    def delay_seconds(self) -> float:
        return parse_delay(self.latency)

    @property
    def round_trip_bytes(self) -> int:
        """What the link carries in a round trip with the shaper's queue full both ways: the TCP window it needs."""
        return int(self.bits_per_second / 8 * 2 * (QUEUE_SECONDS + self.delay_seconds))


@dataclass
class TwoNodeTestbed:
    """Two namespaces ``hpzbench-<pid>-node0/1`` joined by veth ends ``hpzb<pid>n0/1`` at ``10.77.0.1/2``.

    Use as a context manager. Names carry the id of the process that owns the testbed, so concurrent testbeds never
    collide and :func:`sweep_abandoned` can tell a testbed whose owner was killed outright (SIGKILL).
    """

    shape: LinkShape = field(default_factory=LinkShape)
    owner_pid: int = field(default_factory=os.getpid)
    created: list[str] = field(default_factory=list)  # namespaces to delete, in creation order

    def namespace(self, node: int) -> str:
        return f"{NAMESPACE_PREFIX}{self.owner_pid}-node{node}"

    def interface(self, node: int) -> str:
        # At most 15 characters (the kernel's limit); the ends live inside the namespaces, so only creation, in the
        # root namespace for a moment, could meet another testbed's names.
        return f"hpzb{self.owner_pid % 100000}n{node}"

    def address(self, node: int) -> str:
        return f"{SUBNET_PREFIX}.{node + 1}"

    def __enter__(self) -> TwoNodeTestbed:
        self.build()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def build(self) -> None:
        reason = unavailable_reason()
        if reason:
            raise TestbedUnavailableError(f"cannot build the two-node testbed: {reason}.")
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        for node in (0, 1):
            _run(["ip", "netns", "add", self.namespace(node)])
            self.created.append(self.namespace(node))
        _run(["ip", "link", "add", self.interface(0), "type", "veth", "peer", "name", self.interface(1)])
        for node in (0, 1):
            ns, dev = self.namespace(node), self.interface(node)
            _run(["ip", "link", "set", dev, "netns", ns])
            _run(["ip", "-n", ns, "link", "set", dev, "mtu", str(self.shape.mtu)])
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", dev])
            _run(["ip", "-n", ns, "link", "set", dev, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])  # intra-node traffic goes over loopback
            self._size_socket_buffers(ns)
            self._shape_egress(ns, dev)

    def _size_socket_buffers(self, ns: str) -> None:
        # Gloo sends both ways on one connection, so a sender's ACKs can wait behind the other node's data in the
        # shaper's queue, and --latency adds its delay both ways. A TCP window capped below rate x that round trip
        # (at 2 Gbit/s Linux's usual 4 MiB cap is a twelfth of it) can hold a flow below the link's rate. The limits
        # are the namespace's own and go with it.
        needed = self.shape.round_trip_bytes
        for key in ("net.ipv4.tcp_wmem", "net.ipv4.tcp_rmem"):
            low, default, high = _run(["ip", "netns", "exec", ns, "sysctl", "-n", key]).split()
            if int(high) < needed:
                _run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"{key}={low} {default} {needed}"])

    def _tbf(self, bandwidth: str) -> list[str]:
        # The token bucket must hold at least one full frame, and enough for the rate at the kernel's timer tick.
        burst = max(4 * self.shape.mtu, int(parse_rate(bandwidth) / 8 / 250))
        return ["tbf", "rate", bandwidth, "burst", str(burst), "latency", f"{QUEUE_SECONDS * 1000:g}ms"]

    def _shape_egress(self, ns: str, dev: str) -> None:
        tbf = self._tbf(self.shape.bandwidth)
        if self.shape.delay_seconds == 0:
            _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *tbf])
            return
        try:
            netem = ["netem", "delay", self.shape.latency]
            _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *netem])
        except TestbedError as err:
            raise TestbedUnavailableError(
                f"--latency {self.shape.latency} needs tc's netem qdisc, which this kernel does not provide ({err}). "
                "Rerun with --latency 0 to limit the bandwidth only."
            ) from err
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:", "handle", "2:", *tbf])

    def change_bandwidth(self, bandwidth: str) -> None:
        """Reshape the running link to ``bandwidth`` both ways (connections stay open; fault-injection tests)."""
        for node in (0, 1):
            parent = ["root"] if self.shape.delay_seconds == 0 else ["parent", "1:", "handle", "2:"]
            ns, dev = self.namespace(node), self.interface(node)
            _run(["tc", "-n", ns, "qdisc", "change", "dev", dev, *parent, *self._tbf(bandwidth)])

    def set_link(self, up: bool) -> None:
        """Cut the link between the nodes (``up=False``: node 1's end goes down) or restore it."""
        _run(["ip", "-n", self.namespace(1), "link", "set", self.interface(1), "up" if up else "down"])

    def tx_bytes(self, node: int) -> int:
        """Bytes the node's veth end has sent to the other node so far."""
        out = _run(["ip", "netns", "exec", self.namespace(node), "cat", self.counter_path(node)])
        return int(out.strip())

    def counter_path(self, node: int) -> str:
        # Inside the namespace (ip netns exec remounts /sys) this file is the veth end's transmit counter.
        return f"/sys/class/net/{self.interface(node)}/statistics/tx_bytes"

    def exec_prefix(self, node: int) -> list[str]:
        """Prefix a command with this to run it on ``node``."""
        return ["ip", "netns", "exec", self.namespace(node)]

    def close(self) -> None:
        """Delete the namespaces (the veth pair goes with them). Safe to call twice."""
        while self.created:
            ns = self.created.pop()
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True, check=False)
        # A veth pair created before a failure to move it into a namespace would otherwise survive.
        subprocess.run(["ip", "link", "del", self.interface(0)], capture_output=True, text=True, check=False)

    def leftovers(self) -> list[str]:
        """Names of this testbed that still exist on the machine (empty after :meth:`close`)."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=False).stdout
        names = [self.namespace(0), self.namespace(1), self.interface(0), self.interface(1)]
        return [name for name in names if re.search(rf"\b{re.escape(name)}\b", listed + links)]


def sweep_abandoned() -> list[str]:
    """Delete testbed namespaces whose owning process no longer exists (it was killed before it could clean up)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    removed = []
    for line in listed.splitlines():
        name = line.split(" ", 1)[0]
        match = _OWNED_NAMESPACE.match(name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True, check=False)
            removed.append(name)
    return removed


def _run(command: list[str]) -> str:
    completed = subprocess.run(command, capture_output=True, text=True, check=False)
    if completed.returncode != 0:
        raise TestbedError(f"`{' '.join(command)}` failed: {completed.stderr.strip() or completed.returncode}")
    return completed.stdout
