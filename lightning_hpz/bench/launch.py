"""Start benchmark configurations on the testbed: a torchrun agent per node, ranks bound to the veth pair."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from lightning_hpz.bench.testbed import TwoNodeTestbed
from lightning_hpz.lifecycle.launched_ranks import (
    child_environment,
    clear_rank_records,
    end_process_group,
    read_rank_records,
)


class ConfigurationFailedError(RuntimeError):
    """A configuration's processes failed or ran out of time; the message points at its log."""


@dataclass
class Launch:
    """Where a configuration runs and how long it may take."""

    testbed: TwoNodeTestbed
    devices_per_node: int
    port: int
    timeout_s: float


def torchrun_command(testbed: TwoNodeTestbed, node: int, devices: int, port: int, spec_path: Path) -> list[str]:
    return [
        *testbed.exec_prefix(node),
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        f"--node-rank={node}",
        f"--nproc-per-node={devices}",
        f"--master-addr={testbed.address(0)}",
        f"--master-port={port}",
        "--max-restarts=0",
        "-m",
        "lightning_hpz.bench.worker",
        str(spec_path),
    ]


def node_environment(testbed: TwoNodeTestbed, node: int) -> dict[str, str]:
    env = child_environment()
    env.update(
        GLOO_SOCKET_IFNAME=testbed.interface(node),  # gloo binds here; same-node peers then meet over loopback
        OMP_NUM_THREADS="1",
        LIGHTNING_HPZ_EMULATE_ASYNC_COPY="0",
        DS_ACCELERATOR="cpu",  # the benchmark trains on CPU processes, also on a machine with a GPU
    )
    return env


def run_configuration(launch: Launch, spec: dict[str, Any], run_dir: Path) -> list[dict[str, Any]]:
    """Train one configuration on both nodes; return every rank's record, ordered by rank."""
    clear_rank_records(run_dir)
    run_ranks(launch, spec, run_dir)
    return read_records(run_dir, 2 * launch.devices_per_node, run_dir / "log.txt")


def run_sequence(
    launch: Launch, spec: dict[str, Any], run_dir: Path
) -> tuple[list[Optional[list[dict[str, Any]]]], Optional[str]]:
    """Train the configurations of ``spec["runs"]`` one after the other in the same processes (one launch).

    Each entry of ``spec["runs"]`` names its own ``"out"`` folder. Returns each entry's records (``None`` where the
    ranks wrote none: the entry failed or was not reached) and the launch's error, if it failed; what finished before
    a failure is kept.
    """
    outs = [Path(entry["out"]) for entry in spec["runs"]]
    for out in outs:
        clear_rank_records(out)
    error = None
    try:
        run_ranks(launch, spec, run_dir)
    except ConfigurationFailedError as err:
        error = str(err)
    records: list[Optional[list[dict[str, Any]]]] = []
    for out in outs:
        try:
            records.append(read_records(out, 2 * launch.devices_per_node, run_dir / "log.txt"))
        except ConfigurationFailedError:
            records.append(None)
    return records, error


def run_ranks(launch: Launch, spec: dict[str, Any], run_dir: Path) -> None:
    """Start a torchrun agent per node on ``spec`` (written to ``run_dir/spec.json``) and wait for both to end."""
    run_dir.mkdir(parents=True, exist_ok=True)
    spec_path = run_dir / "spec.json"
    spec_path.write_text(json.dumps({**spec, "out": str(run_dir)}, indent=1))
    log_path = run_dir / "log.txt"
    with log_path.open("w") as log:
        agents = [
            subprocess.Popen(
                torchrun_command(launch.testbed, node, launch.devices_per_node, launch.port, spec_path),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=node_environment(launch.testbed, node),
                start_new_session=True,  # own process group: Ctrl-C reaches us, and we end the whole group
            )
            for node in (0, 1)
        ]
        try:
            _wait(agents, launch.timeout_s, log_path)
        finally:
            for agent in agents:
                end_process_group(agent)


def read_records(out: Path, expected: int, log_path: Path) -> list[dict[str, Any]]:
    """Every rank's record in ``out``, ordered by rank; refuses a folder where a rank wrote none."""
    records = read_rank_records(out)
    if len(records) != expected:
        raise ConfigurationFailedError(f"{len(records)} of {expected} ranks wrote results; see {log_path}.")
    return records


def _wait(agents: list[subprocess.Popen], timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = [agent.poll() for agent in agents]
        if any(code not in (None, 0) for code in codes):
            raise ConfigurationFailedError(f"a node's torchrun exited with {codes}; see {log_path}.")
        if all(code == 0 for code in codes):
            return
        time.sleep(0.5)
    raise ConfigurationFailedError(f"did not finish within {timeout_s:.0f} s; see {log_path}.")
