"""The GPU acceptance script: its CUDA checks under ``pytest -m cuda`` on a GPU machine; anywhere else, its CPU
stand-ins run and the CUDA checks are reported SKIP with the reason instead of failing."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import import_benchmark

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_acceptance.py"
CUDA_CHECKS = ["ordering_on_cuda_streams", "collectives_under_nccl", "trainer_on_one_gpu"]
CUDA_CHECKS_WITH_FOLDER = ["trainer_on_one_gpu", "litgpt_loops_on_one_gpu", "initial_weights_on_one_gpu"]


def _acceptance():
    return import_benchmark("gpu_acceptance")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("check", sorted({*CUDA_CHECKS, *CUDA_CHECKS_WITH_FOLDER}))
def test_cuda_check(check, tmp_path):
    acceptance = _acceptance()
    run = getattr(acceptance, check)
    status, detail = run(tmp_path) if check in CUDA_CHECKS_WITH_FOLDER else run()
    assert status == "PASS", detail


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (one is enough)")
def test_hpz_ranks_on_this_machine(tmp_path):
    status, detail = _acceptance().hpz_ranks(tmp_path, torch.cuda.device_count())
    assert status == "PASS", detail


def _ranks_results(**changes):
    """What hpz_sync_modes.py writes for the hpz_ranks configurations, made up: a run where all went right."""
    run = {"losses": [2.0, 1.5], "val_losses": [1.4], "times": [0.2] * 8, "stale_reads": 0, "gathers_checked": 40,
           "backend": "gloo", "shared_gpu": True, "relayed_through_host": {}}  # fmt: skip
    results = {name: dict(run) for name in _acceptance().RANKS_CONFIGURATIONS.split(",")}
    results["hpz2-none-late"].update(stale_reads=3, losses=[2.0, 9.0])
    results["hpz2-stream"]["times"] = [0.3] * 8
    for name, change in changes.items():
        results[name] = {**results[name], **change}
    return results


@pytest.mark.parametrize(
    ("changes", "status"),
    [
        ({}, "PASS"),
        ({"hpz2-event": {"val_losses": [1.41]}}, "FAIL"),  # validation under inference_mode differs from ZeRO-3
        ({"hpz2-event-late": {"losses": [2.0, 1.6]}}, "FAIL"),  # a late copy changed the numbers despite ordering
        ({"hpz2-none-late": {"stale_reads": 0}}, "FAIL"),  # the race was not seen: the probe proves nothing
        ({"hpz2-event-late": {"stale_reads": 1}}, "FAIL"),
        ({"hpz2-event-late": {"gathers_checked": 0}}, "FAIL"),  # the probe never ran: its 0 proves nothing
        ({"hpz1-event": {"error": "exit code 1"}}, "FAIL"),
    ],
)
def test_hpz_ranks_verdict(changes, status):
    verdict, detail = _acceptance().judge_hpz_ranks(_ranks_results(**changes))
    assert verdict == status, detail
    if status == "PASS":
        assert "event/stream 0.67" in detail and "on one GPU" in detail


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the cuda-marked tests run the real checks")
def test_without_cuda_the_script_runs_its_plumbing_and_skips_the_rest(tmp_path):
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    results = {r["name"]: r for r in json.loads((tmp_path / "results.json").read_text())}
    for name in [*CUDA_CHECKS, *CUDA_CHECKS_WITH_FOLDER, "hpz_ranks"]:
        assert results[name]["status"] == "SKIP" and results[name]["detail"]
    for name in ("ordering_plumbing", "collectives_plumbing", "trainer_plumbing"):
        assert results[name]["status"] == "PASS", results[name]["detail"]
    assert "none: stale" in results["ordering_plumbing"]["detail"]  # the race is reproduced, not just skipped
    assert "| trainer_plumbing | PASS |" in (tmp_path / "results.md").read_text()
