"""A checkpoint folder that is not one folder for every rank (node-local disks) is refused at the first save, on
every rank, naming the ranks that cannot see it: never a checkpoint that only fails at resume. Two CPU ranks, the
second in a mount namespace of its own with an empty tmpfs over the checkpoint folder (root only)."""

import pytest
from conftest import run_script

pytestmark = pytest.mark.multiprocess


@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="mounting a tmpfs in a mount namespace needs root")
def test_first_save_into_node_local_folders_is_refused(tmp_path):
    parent = tmp_path / "node_disk"
    parent.mkdir()
    run = run_script("node_local_checkpoints.py", {"ckpt_parent": str(parent)}, tmp_path / "run", ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    errors = [run.ranks[rank]["error"] for rank in range(2)]
    assert errors[0] == errors[1] and errors[0] is not None
    assert "is not one folder for all ranks: rank 1 on" in errors[0]
    assert "Save to a file system every node mounts" in errors[0]
    assert run.ranks[0]["checkpoints"] == []  # nothing was written that would fail at resume
