"""LossStabilityMonitor and TokenThroughputMonitor on 4 CPU processes under ZeRO-3 + hpZ (5 launches, ~15-60 s each).

One launch per action, each asserting all it honestly can: `skip` (also carries the throughput checks), `skip` under
fp16, `rollback`, `stop`, and a resume from the checkpoint `stop` left.
"""

import csv
import json
import math
from pathlib import Path

import pytest
from conftest import run_script

from lightning_hpz.lifecycle.run_exit import UNSTABLE_EXIT_CODE
from lightning_hpz.planning import ClusterLayout, ZeroSetup, traffic_per_step

pytestmark = pytest.mark.multiprocess
SCRIPT = "callback_training.py"


def launch(out: Path, expected_exit: int = 0, **options) -> dict:
    run = run_script(SCRIPT, options, out, timeout=420, ranks=4)
    assert run.returncode == expected_exit, run.output[-4000:]
    result = json.loads((out / "result.json").read_text())
    result["losses"] = {step: float(value) for step, value in result["losses"].items()}
    result["output"] = run.output
    return result


@pytest.fixture(scope="module")
def skip_run(module_tmp):
    return launch(module_tmp / "skip", action="skip", nan_at_step=5, steps=12, flops_per_token=1e5)


@pytest.fixture(scope="module")
def stop_run(module_tmp):
    return launch(module_tmp / "stop", UNSTABLE_EXIT_CODE, action="stop", nan_at_step=5, steps=12)


def weights_after(result: dict, step: int) -> list[float]:
    return result["after_step"][str(step)]


def test_skip_leaves_weights_exactly_as_before_the_bad_batch(skip_run):
    assert [s["step"] for s in skip_run["skipped"]] == [5]
    assert skip_run["before_bad_step"] == weights_after(skip_run, 4)
    assert weights_after(skip_run, 5) == weights_after(skip_run, 4)
    assert weights_after(skip_run, 6) != weights_after(skip_run, 5)  # training goes on
    assert skip_run["final_weights_finite"]


def _cpu_has_fp16() -> bool:
    import torch

    try:  # what DeepSpeed's CPU accelerator asks before it accepts fp16 (AVX512-FP16 / AMX machines)
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:
        return False


@pytest.mark.skipif(not _cpu_has_fp16(), reason="this CPU has no fp16 arithmetic: DeepSpeed refuses fp16 on it")
def test_fp16_skip_leaves_the_loss_scaler_as_it_was(module_tmp):
    # the host reads the monitor's values every 4 steps here: the drop is decided on the device at step 5
    run = launch(module_tmp / "fp16", action="skip", nan_at_step=5, steps=8, precision="16-mixed", log_every=4)
    assert [s["step"] for s in run["skipped"]] == [5]
    assert weights_after(run, 5) == weights_after(run, 4)
    scaler = run["loss_scaler_after_step"]  # [scale, iteration, last overflow iteration, hysteresis left]
    assert scaler["5"] == scaler["4"]  # no overflow counted, no scale or hysteresis lost, no clean step counted
    assert scaler["6"][1] == scaler["4"][1] + 1  # the next step is the scaler's next iteration
    assert run["engine_skipped_steps"] >= 1  # the engine did discard the step (genuine fp16 overflows may add more)


def test_rollback_restores_last_good_checkpoint_and_skips_the_bad_batch(module_tmp):
    out = module_tmp / "rollback"
    result = launch(out, action="rollback", nan_at_step=6, steps=10, checkpoint_every=4)
    assert result["rollbacks"] == [{"step": 6, "restored_step": 4}]
    assert weights_after(result, 6) == weights_after(result, 3)  # the weights saved after 4 completed steps
    assert [s["step"] for s in result["skipped"]] == [6]
    assert result["global_step"] == 10 and result["final_weights_finite"]
    assert all(math.isfinite(result["losses"][str(step)]) for step in range(7, 10))
    summary = json.loads((out / "stability" / "stability_summary.json").read_text())
    assert (summary["nonfinite_losses"], len(summary["rollbacks"]), len(summary["skipped_batches"])) == (1, 1, 1)
    assert (out / "stability" / "loss_curve.png").stat().st_size > 0
    assert json.loads((out / "stability" / "skip_batches.json").read_text()) == [[0, 6]]


def test_stop_saves_a_checkpoint_and_ends_every_rank_with_a_nonzero_exit(stop_run):
    assert stop_run["exit_code"] == UNSTABLE_EXIT_CODE  # the launch itself exited 3 (asserted in `launch`)
    assert stop_run["global_step"] == 6  # the bad step 5 was the last one
    assert Path(stop_run["stop_checkpoint"]).is_dir()
    assert weights_after(stop_run, 5) == weights_after(stop_run, 4)  # the bad update was dropped before saving
    assert stop_run["stability_summary"]["stopped"]
    last_lines = "\n".join(stop_run["output"].strip().splitlines()[-15:])
    assert "Training stopped by LossStabilityMonitor at step 5: nonfinite_loss" in last_lines


def test_stop_checkpoint_resumes_and_warn_counts_the_update_the_engine_dropped(stop_run, module_tmp):
    # action="warn" asks for nothing to be skipped, but DeepSpeed's overflow guard drops the NaN step 7 by itself
    result = launch(
        module_tmp / "resume", action="warn", steps=9, nan_at_step=7, resume_from=stop_run["stop_checkpoint"]
    )
    assert result["global_step"] == 9
    assert sorted(result["losses"], key=int) == ["6", "7", "8"]
    assert result["final_weights_finite"]
    assert math.isnan(result["losses"]["7"]) and math.isfinite(result["losses"]["8"])
    summary = result["stability_summary"]
    assert [s["step"] for s in summary["skipped_batches"]] == [5]  # the stopped run's; at step 7 it skipped nothing
    assert summary["updates_dropped_by_engine"] == 1  # ... and says what really happened
    assert result["engine_skipped_steps"] == 2  # step 5 of the stopped run, restored with its checkpoint, and step 7


def logged_metrics(out: Path) -> list[dict]:
    with open(out / "logs" / "version_0" / "metrics.csv") as handle:
        return [row for row in csv.DictReader(handle) if row.get("throughput/tokens_per_sec")]


def test_logged_tokens_per_second_match_tokens_processed_over_time(skip_run, module_tmp):
    last = skip_run["throughput"][-1]  # rank 0's record of what it logged, at global step `step`
    logged = [float(row["throughput/tokens_per_sec"]) for row in logged_metrics(module_tmp / "skip")]
    assert last["throughput/tokens_per_sec"] == pytest.approx(logged[-1])
    step, window = last["step"], 8  # TokenThroughputMonitor(window_size=8): rates over the last 7 steps
    tokens = skip_run["real_tokens_per_step"][step - window + 1 : step]  # all ranks, counted by the model
    times = skip_run["batch_end_times"]
    expected = sum(tokens) / (times[step - 1] - times[step - window])
    assert last["throughput/tokens_per_sec"] == pytest.approx(expected, rel=1e-6)
    assert last["throughput/device/tokens_per_sec"] == pytest.approx(expected / 4, rel=1e-6)
    assert last["throughput/device/tflops_per_sec"] > 0 and last["throughput/device/mfu"] > 0


def test_logged_bytes_per_step_come_from_the_planning_model(skip_run, module_tmp):
    last = logged_metrics(module_tmp / "skip")[-1]
    # One node of 4 CPU ranks over gloo, ZeRO-3 + hpZ(2), fp32, parameters re-gathered in backward.
    expected = traffic_per_step(
        skip_run["parameters"], ZeroSetup(3, 2), ClusterLayout(1, 4), 4, 4, True, gradient_reduction="all_reduce"
    )
    assert float(last["comm/intra_node_bytes_per_step"]) == pytest.approx(expected.intra_node_bytes)
    assert float(last["comm/inter_node_bytes_per_step"]) == 0.0
