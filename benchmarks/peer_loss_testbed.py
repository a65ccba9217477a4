"""A lost node, a cut link and a slowed link on the two-node testbed: how long the surviving ranks take to exit.

    sudo python benchmarks/peer_loss_testbed.py --faults kill cut slow --out /tmp/peer_loss

For each fault, one two-node Lightning job (ZeRO-3, ``HpzStrategy`` with its peer watchdog, a checkpoint committed
every 3 steps) starts on the testbed (200 Mbit/s), trains past its first checkpoint, and then:

- ``kill``: every rank of node 1 is SIGKILLed (all of the node's ranks OOM-killed, or the node gone);
- ``cut``: node 1's end of the link goes down (``ip link set ... down``) and stays down;
- ``slow``: the link drops to 1/100 of its rate (2 Mbit/s) for ``--slow-seconds``, then comes back; the job must
  finish normally.

Prints a Markdown table (fault, seconds from the fault to each surviving node's exit, exit codes, whether the last
committed checkpoint verifies against its manifest) and writes ``results.json``. A node is one ``python`` process
started as a user starts one (``--devices`` ranks; Lightning's launcher starts the others, and the first carries the
node's exit code): with ``--devices 1``, node n is rank n. Needs root, ``ip`` and ``tc``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from lightning_hpz.bench.launch import node_environment
from lightning_hpz.bench.testbed import LinkShape, TwoNodeTestbed
from lightning_hpz.checkpointing.manifest import read_manifest, verify_files
from lightning_hpz.lifecycle.launched_ranks import end_process_group  # SIGTERM, then SIGKILL: the clean-up

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "scripts" / "peer_loss_training.py"
BANDWIDTH = "200mbit"
SLOWED = "2mbit"  # 1/100
FAULT_AT_STEP = 7
LOST = "ends the run with exit code"  # the watchdog's message  # after the checkpoints of steps 3 and 6


def launch(testbed: TwoNodeTestbed, out: Path, options: dict[str, Any], port: int) -> list[subprocess.Popen]:
    command = [sys.executable, str(SCRIPT), json.dumps({**options, "out": str(out)})]
    nodes = []
    for node in (0, 1):
        env = node_environment(testbed, node)
        env.update(MASTER_ADDR=testbed.address(0), MASTER_PORT=str(port), NODE_RANK=str(node))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SCRIPT.parents[2]), os.environ.get("PYTHONPATH")]))
        log = (out / f"node{node}.log").open("w")
        nodes.append(
            subprocess.Popen(
                [*testbed.exec_prefix(node), *command],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # the node's ranks in one process group: killed together
            )
        )
    return nodes


def rank_record(out: Path, rank: int) -> dict[str, Any]:
    try:
        return json.loads((out / f"rank{rank}.json").read_text())
    except (OSError, ValueError):
        return {}


def wait_for_step(out: Path, step: int, nodes: list[subprocess.Popen], timeout: float, ranks: range) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if min(rank_record(out, rank).get("step", -1) for rank in ranks) >= step:
            return
        if any(node.poll() is not None for node in nodes):
            raise RuntimeError(f"a node exited before step {step}; see {out}/node*.log")
        time.sleep(0.2)
    raise RuntimeError(f"step {step} not reached in {timeout:.0f} s; see {out}/node*.log")


def wait_for_exits(nodes: dict[int, subprocess.Popen], since: float, timeout: float) -> dict[int, dict[str, Any]]:
    """Exit code and seconds from ``since`` of each node's process (``None`` for one still running at the timeout)."""
    ended: dict[int, dict[str, Any]] = {}
    deadline = since + timeout
    while len(ended) < len(nodes) and time.monotonic() < deadline:
        for node, process in nodes.items():
            if node not in ended and process.poll() is not None:
                ended[node] = {"code": process.returncode, "seconds": round(time.monotonic() - since, 1)}
        time.sleep(0.1)
    return {node: ended.get(node, {"code": None, "seconds": None}) for node in nodes}


def checkpoint_verifies(path: Optional[str]) -> tuple[bool, str]:
    if not path:
        return False, "no checkpoint committed"
    manifest = read_manifest(Path(path))
    if manifest is None:
        return False, f"{path}: no manifest"
    problems = verify_files(Path(path), manifest, list(manifest["files"]))
    return not problems, "; ".join(problems) or f"{path} (step {manifest['run'].get('global_step')})"


def run_fault(fault: str, out: Path, args: argparse.Namespace, port: int) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    options = {"peer_timeout": args.peer_timeout, "steps": args.slow_steps if fault == "slow" else 100000}
    options["devices"] = args.devices
    ranks = range(2 * args.devices)
    with TwoNodeTestbed(LinkShape(bandwidth=BANDWIDTH)) as testbed:
        nodes = launch(testbed, out, options, port)
        try:
            wait_for_step(out, FAULT_AT_STEP, nodes, args.start_timeout, ranks)
            committed = rank_record(out, 0).get("committed")
            slowed_steps = None
            started = time.monotonic()
            if fault == "kill":
                os.killpg(nodes[1].pid, signal.SIGKILL)  # the node's ranks share its process group
                survivors = {0: nodes[0]}
            elif fault == "cut":
                testbed.set_link(up=False)
                survivors = {0: nodes[0], 1: nodes[1]}
            else:
                testbed.change_bandwidth(SLOWED)
                slowed_from = rank_record(out, 0).get("step")
                time.sleep(args.slow_seconds)
                slowed_steps = [slowed_from, rank_record(out, 0).get("step")]
                testbed.change_bandwidth(BANDWIDTH)
                survivors = {0: nodes[0], 1: nodes[1]}
            exits = wait_for_exits(survivors, started, timeout=args.exit_timeout + (args.slow_seconds * 4))
        finally:
            for node in nodes:
                end_process_group(node, grace_s=5)
    if fault == "slow":
        committed = rank_record(out, 0).get("committed")
    resumable, detail = checkpoint_verifies(committed)
    logs = {node: (out / f"node{node}.log").read_text() for node in (0, 1)}
    return {
        "fault": fault,
        "exits": {str(node): exit for node, exit in exits.items()},
        "checkpoint": committed,
        "checkpoint_verifies": resumable,
        "checkpoint_detail": detail,
        "slowest_heartbeat_s": {str(r): rank_record(out, r).get("slowest_heartbeat_s") for r in ranks},
        "steps": {str(r): rank_record(out, r).get("step") for r in ranks},
        "failed_heartbeat_calls": {str(r): rank_record(out, r).get("failed_heartbeat_calls") for r in ranks},
        "slowed_between_steps": slowed_steps,
        "messages": {
            str(n): [line for line in log.splitlines() if "ends the run with exit code" in line]
            for n, log in logs.items()
        },
    }


FAULT_NAMES = {
    "kill": "SIGKILL every rank of node 1",
    "cut": "link cut (node 1's veth down)",
    "slow": "link slowed 100-fold (200 -> 2 Mbit/s)",
}


def table(results: list[dict[str, Any]]) -> str:
    rows = [
        "| fault | seconds to exit (node: s) | exit codes (node: code) | last committed checkpoint verifies |"
        " slowest heartbeat (rank: s) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for result in results:
        exits = result["exits"]
        seconds = ", ".join(f"{r}: {e['seconds']}" for r, e in exits.items())
        codes = ", ".join(f"{r}: {e['code']}" for r, e in exits.items())
        slowest = ", ".join(f"{r}: {s:.2f}" for r, s in result["slowest_heartbeat_s"].items() if s is not None)
        verifies = "yes" if result["checkpoint_verifies"] else f"no ({result['checkpoint_detail']})"
        rows.append(f"| {FAULT_NAMES[result['fault']]} | {seconds} | {codes} | {verifies} | {slowest} |")
    return "\n".join(rows)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", nargs="+", choices=sorted(FAULT_NAMES), default=["kill", "cut", "slow"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--peer-timeout", type=float, default=45.0)
    parser.add_argument("--devices", type=int, default=1, help="ranks per node")
    parser.add_argument("--slow-seconds", type=float, default=60.0, help="how long the link stays slowed")
    parser.add_argument("--slow-steps", type=int, default=40, help="steps of the slowed run (it must finish)")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--exit-timeout", type=float, default=150.0)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the testbed is removed on the way out
    results = [run_fault(fault, args.out / fault, args, 29600 + i) for i, fault in enumerate(args.faults)]
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
