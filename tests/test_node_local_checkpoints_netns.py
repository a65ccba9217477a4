"""Checkpoint folders on the real two-node testbed (root, ``ip`` and ``tc`` needed): a folder both nodes share saves and
resumes; a folder that is each node's own at the same path is refused at its first save, on every rank, quickly.

One launch (``tests/scripts/node_checkpoint_folders.py``, 2 nodes x 1 CPU rank over gloo across the veth link,
ZeRO-3): each node runs in a mount namespace of its own (``unshare --mount``) with its own folder bind-mounted over
the same path, ``local``, as node-local disks are; ``shared`` is one folder for both. The job saves into ``shared``,
resumes there with ``ckpt_path="last"`` (the check must not take network namespaces for separate disks), then trains
into ``local``, whose first save must end both nodes with ``CheckpointStorageError`` long before the peer watchdog
(45 s) or a collective (30 min) would, having written no checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import netns_marks

from lightning_hpz.bench.launch import node_environment
from lightning_hpz.bench.testbed import TwoNodeTestbed
from lightning_hpz.checkpointing.manifest import read_manifest, verify_files
from lightning_hpz.lifecycle.launched_ranks import end_process_group

pytestmark = netns_marks()
REPOSITORY = Path(__file__).resolve().parents[1]
SCRIPT = REPOSITORY / "tests" / "scripts" / "node_checkpoint_folders.py"
PORT = 29500  # in node 0's namespace, which this test created: nothing else listens there
JOB_TIMEOUT_S = 300.0
# from the first save into `local` to the exit of both nodes: well below the peer watchdog's 45 s, which would end a
# hung rank with exit code 76, and gloo's 30-minute collective timeout
REFUSAL_BOUND_S = 20.0
# `ip netns exec` enters a mount namespace of its own already; unshare makes that explicit and private, so that the
# bind mount is this node's alone and goes when its processes exit
OWN_FOLDER = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'


def launch(testbed: TwoNodeTestbed, node: int, root: Path, options: dict) -> subprocess.Popen:
    env = node_environment(testbed, node)
    env.update(MASTER_ADDR=testbed.address(0), MASTER_PORT=str(PORT), NODE_RANK=str(node))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")]))
    own = ["unshare", "--mount", "--propagation", "private", "sh", "-c", OWN_FOLDER, "own-folder"]
    command = [*testbed.exec_prefix(node), *own, str(root / f"node{node}_disk"), options["local"]]
    command += [sys.executable, str(SCRIPT), json.dumps(options)]
    log = (root / f"node{node}.log").open("w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_for_exits(nodes: list[subprocess.Popen], timeout: float) -> list[tuple[int | None, float | None]]:
    """Each node's exit code and wall-clock time of its exit (``None`` for one still running at the timeout)."""
    ended: dict[int, tuple[int, float]] = {}
    deadline = time.monotonic() + timeout
    while len(ended) < len(nodes) and time.monotonic() < deadline:
        for node, process in enumerate(nodes):
            if node not in ended and process.poll() is not None:
                ended[node] = (process.returncode, time.time())
        time.sleep(0.05)
    return [ended.get(node, (None, None)) for node in range(len(nodes))]


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("node_checkpoint_folders")
    options = {"out": str(root), "shared": str(root / "shared"), "local": str(root / "local")}
    for name in ("shared", "local", "node0_disk", "node1_disk"):
        (root / name).mkdir()
    started = time.monotonic()
    with TwoNodeTestbed() as testbed:
        nodes = [launch(testbed, node, root, options) for node in (0, 1)]
        try:
            exits = wait_for_exits(nodes, JOB_TIMEOUT_S)
        finally:
            for node in nodes:
                end_process_group(node, grace_s=5)
    logs = "".join(f"--- node {n}\n" + (root / f"node{n}.log").read_text()[-3000:] for n in (0, 1))
    assert all(code is not None for code, _ in exits), f"the job hung past {JOB_TIMEOUT_S} s\n{logs}"
    records = [json.loads(path.read_text()) for path in sorted(root.glob("rank[01].json"))]
    assert [record["rank"] for record in records] == [0, 1], logs
    return {"root": root, "exits": exits, "records": records, "logs": logs, "seconds": time.monotonic() - started}


def test_a_shared_folder_saves_and_resumes_across_the_nodes(job):
    shared = job["root"] / "shared"
    for record in job["records"]:
        assert record["shared"]["first"] == [0, 2], job["logs"]
        assert record["shared"]["resumed"] == [2, 4], job["logs"]
        assert record["shared"]["resumed_from"] == str(shared / "last.ckpt")
    manifest = read_manifest(shared / "last.ckpt")
    assert manifest["run"]["global_step"] == 4 and manifest["run"]["world_size"] == 2
    assert verify_files(shared / "last.ckpt", manifest, list(manifest["files"])) == []


def test_node_local_folders_end_every_rank_at_the_first_save_naming_rank_1(job):
    errors = [record["local"]["error"] for record in job["records"]]
    assert errors[0] is not None and errors[0] == errors[1], job["logs"]
    # the folder as ModelCheckpoint was given it, not the package's hidden staging folder inside it
    assert f"Checkpoint folder {job['root'] / 'local'} is not one folder for all ranks: rank 1 on " in errors[0]
    assert "rank 0 on" not in errors[0]
    assert "Save to a file system every node mounts" in errors[0]
    assert [record["local"]["first_save"][0] for record in job["records"]] == [2, 2]
    assert [code for code, _ in job["exits"]] == [1, 1], job["logs"]  # the error's exit, not the watchdog's 76
    assert all("CheckpointStorageError" in (job["root"] / f"node{n}.log").read_text() for n in (0, 1))
    save_began = min(record["local"]["first_save"][1] for record in job["records"])
    to_error = [record["local"]["raised_at"] - save_began for record in job["records"]]
    to_exit = [exited - save_began for _, exited in job["exits"]]
    print(f"first save -> error {to_error} s, -> exit {to_exit} s; whole job {job['seconds']:.1f} s")
    assert max(to_exit) < REFUSAL_BOUND_S, to_exit


def test_node_local_folders_hold_no_checkpoint_after_the_refusal(job):
    for node in (0, 1):
        disk = job["root"] / f"node{node}_disk"
        assert [path for path in disk.rglob("*") if path.is_file()] == [], node
    assert list((job["root"] / "local").iterdir()) == []  # the bind mounts were each node's alone
