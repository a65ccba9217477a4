"""benchmarks/hpz_sync_modes.py: what it needs on a machine without CUDA, its CPU plumbing run (hpZ 2 in parity
with DeepSpeed alone, validation under inference_mode, bf16), and the host relay its one-GPU mode may need."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "hpz_sync_modes.py"
PHASES = ("copy", "copy_sync", "wait", "wait_device", "gather_issue", "gather_wait")
NO_GPU = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, also on a GPU machine


def _run(tmp_path, *arguments, timeout=120):
    command = [sys.executable, str(SCRIPT), *arguments, "--out", str(tmp_path)]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=NO_GPU)


def test_without_cuda_names_the_cpu_option(tmp_path):
    result = _run(tmp_path, "--steps", "2")
    assert result.returncode != 0
    assert "--device cpu" in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert not list(tmp_path.iterdir()), "no job may start"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--configurations", "zero3-stock,hpz9"], "unknown configurations ['hpz9']"),
        (["--ranks", "2"], "at least 4"),
        (["--ranks", "1", "--configurations", "zero3-stock,hpz2-event"], "only hpZ 1 configurations"),
    ],
)
def test_bad_arguments_are_refused_before_any_job(tmp_path, arguments, message):
    result = _run(tmp_path, "--device", "cpu", *arguments)
    assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]
    assert not list(tmp_path.iterdir())


@pytest.mark.multiprocess
def test_cpu_plumbing_hpz2_matches_deepspeed_alone_with_inference_mode_validation(tmp_path):
    arguments = ["--device", "cpu", "--ranks", "4", "--steps", "3", "--width", "64", "--bf16", "--validate-every", "2"]
    result = _run(tmp_path, *arguments, "--configurations", "zero3-stock,hpz2-event", timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    reference, hpz = results["zero3-stock"], results["hpz2-event"]
    assert "error" not in hpz, hpz.get("output")
    assert len(hpz["losses"]) == 3 and len(hpz["val_losses"]) == 1  # evaluated under inference_mode after step 2
    assert (hpz["losses"], hpz["val_losses"]) == (reference["losses"], reference["val_losses"])
    assert "| hpz2-event | gloo |" in (tmp_path / "results.md").read_text()
    # each step split into hpZ's phases (what explains one mode's step time against another's on a GPU)
    assert "phases" not in reference  # DeepSpeed alone: nothing of the package's to time
    assert len(hpz["phases"]) == 3 and all(set(step) == {"step", *PHASES} for step in hpz["phases"])
    assert [step["step"] for step in hpz["phases"]] == hpz["times"]
    assert all(step["copy"] > 0 and step["gather_issue"] > 0 for step in hpz["phases"])  # hpZ 2 copies and gathers


@pytest.mark.multiprocess
def test_host_relay_gives_what_gloo_gives(module_tmp):
    run = run_script("host_relay.py", {}, module_tmp / "relay", ranks=2)
    assert run.returncode == 0, run.output[-3000:]
    for rank, record in run.ranks.items():
        assert record["relayed"] == record["native"], rank
        assert len(record["native"]) == 10
