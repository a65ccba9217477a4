"""``lightning-hpz plan --probe``: refused outside a launch, and a real 2-process torchrun prints the tuner's table."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lightning_hpz.cli import main as cli_main


def test_probe_outside_a_launch_says_how_to_start_it(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit, match=r"torchrun --nnodes 2 .*plan --probe"):
        cli_main(["plan", "--probe", "--params", "1e8"])


def test_probe_under_torchrun_prints_candidates_and_the_choice(tmp_path):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "lightning_hpz.cli", "plan", "--probe", "--params", "2e7", "--memory-gib", "4",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert sum(" <- chosen" in line for line in lines) == 1  # printed once, by rank 0
    assert any(line.startswith("links: intra-node ") and "Gbit/s" in line for line in lines)
    assert "memory budget 4.00 GiB/rank" in done.stdout
    assert not any(line.startswith("hpz2-") for line in lines)  # one node: hpZ has nothing to save
