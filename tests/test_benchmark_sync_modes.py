"""benchmarks/hpz_sync_modes.py says what it needs on a machine without CUDA instead of crashing."""

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "hpz_sync_modes.py"


def test_without_cuda_names_the_cpu_option(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, also on a GPU machine
    command = [sys.executable, str(SCRIPT), "--steps", "2", "--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode != 0
    assert "--device cpu" in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert not list(tmp_path.iterdir()), "no job may start"
