"""benchmarks/gpu_evidence.py in its tiny mode: every part's code path on CPU processes (the four-rank phase split is
checked by tests/test_benchmark_sync_modes.py's plumbing run), and the JSON a GPU run will fill."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import import_benchmark

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_evidence.py"
PARTS = "throughput,sync_cost,trainer_stages,nccl_sync_modes"


def _evidence():
    return import_benchmark("gpu_evidence")


@pytest.fixture(scope="module")
def tiny_run(module_tmp):
    out = module_tmp / "evidence"
    command = [sys.executable, str(SCRIPT), "--tiny", "--parts", PARTS, "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "results.json").read_text()), (out / "results.md").read_text()


@pytest.mark.multiprocess
def test_throughput_of_every_configuration_against_deepspeed(tiny_run):
    results, markdown = tiny_run
    runs = results["throughput"]["configurations"]
    assert list(runs) == ["deepspeed", "hpz", "fsdp2", "ddp"]
    scale = results["setup"]["scale"]
    for name, run in runs.items():
        assert "error" not in run, (name, run.get("output"))
        assert run["micro_batch"] == scale["micro_batches"][0] and run["same_micro_batch_as_deepspeed"], name
        assert run["measured_steps"] == scale["steps"] == len(run["step_times"]), name
        assert len(run["losses"]) == scale["warmup"] + scale["steps"] and all(map(math.isfinite, run["losses"]))
        assert run["tokens_per_s"] > 0 and run["peak_memory_gib"] > 0 and 0 < run["mfu"] < 1, name
        # tokens/s is the steps' tokens over their summed time
        tokens = run["micro_batch"] * run["seq"] * run["measured_steps"]
        assert run["tokens_per_s"] == pytest.approx(tokens / sum(run["step_times"]))
        ratio = run["tokens_per_s"] / runs["deepspeed"]["tokens_per_s"]
        assert run["tokens_per_s_vs_deepspeed"] == pytest.approx(ratio), name
    assert runs["hpz"]["same_config_as_deepspeed"], (runs["hpz"]["config"], runs["deepspeed"]["config"])
    assert len({run["flops_per_token"] for run in runs.values()}) == 1  # one model, one count
    assert "| HpzStrategy ZeRO-3, Trainer | 4 |" in markdown


@pytest.mark.multiprocess
def test_sync_cost_counts_each_modes_ordering(tiny_run):
    record = tiny_run[0]["sync_cost"]
    modes = record["modes"]
    copies = modes["event"]["secondary_copies_per_step"]
    assert copies == len([s for layer in _evidence().parameter_shapes(_evidence().TINY.model) for s in layer])
    assert (modes["none"]["host_syncs_per_step"], modes["none"]["events_recorded_per_step"]) == (0, 0)
    assert (modes["event"]["host_syncs_per_step"], modes["event"]["events_recorded_per_step"]) == (0, copies)
    assert (modes["stream"]["host_syncs_per_step"], modes["stream"]["events_recorded_per_step"]) == (copies, 0)
    for mode in modes.values():
        assert mode["median_step_s"] > 0 and set(mode["host_seconds_per_step"]) == {
            "copy",
            "copy_sync",
            "wait",
            "gather",
        }
    assert record["event_vs_stream"] == pytest.approx(
        modes["event"]["median_step_s"] / modes["stream"]["median_step_s"]
    )


@pytest.mark.multiprocess
def test_second_stage_on_the_same_module_and_the_callbacks(tiny_run):
    record = tiny_run[0]["trainer_stages"]
    assert "error" not in record, record.get("output")
    assert record["global_step"] == 12 and math.isfinite(record["val_loss"]) and math.isfinite(record["test_loss"])
    expected = {"TokenThroughputMonitor", "LossStabilityMonitor", "SecondaryPartitionCheck", "PreemptionCheckpoint"}
    assert expected <= set(record["callbacks"])
    if not torch.cuda.is_available():
        assert "needs CUDA" in record["sync_audit"]["skipped"]


@pytest.mark.multiprocess
def test_one_rank_sync_modes_match_deepspeed(tiny_run):
    record = tiny_run[0]["nccl_sync_modes"]
    assert "error" not in record, record.get("output")
    assert record["ranks"] == 1 and record["bit_identical_to_deepspeed"] == {"zero3-stock": True, "hpz1-event": True}


def test_parameter_count_and_shapes_match_the_model_built():
    evidence = _evidence()
    from lightning_hpz.models.architectures import build_hf_model, hf_config

    for settings in (evidence.LLAMA2_1B, evidence.LLAMA2_TINY):
        with torch.device("meta"):
            model = build_hf_model("llama2", hf_config("llama2", settings))
        built = sum(p.numel() for p in model.parameters())
        assert evidence.parameter_count(settings) == built
        assert sum(math.prod(s) for layer in evidence.parameter_shapes(settings) for s in layer) == built
    assert 1.0e9 < evidence.parameter_count(evidence.LLAMA2_1B) < 1.2e9


def test_micro_batch_guess_grows_with_memory():
    evidence = _evidence()
    guesses = [evidence.micro_batch_guess(evidence.GPU, gib * 2**30) for gib in (10, 40, 80, 141, 10_000)]
    assert guesses == sorted(guesses) and guesses[0] == 1 and guesses[-1] == evidence.GPU.micro_batches[0]
