"""One real cell: ``lightning-hpz study`` trains a tiny Llama-2 under ZeRO-3 + hpZ on 2 CPU processes (DeepSpeed over
gloo), records what the study promises, and a second run over the same folder skips the finished cell."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import yaml

from lightning_hpz.planning import ClusterLayout, ZeroSetup, memory_per_rank
from lightning_hpz.study.command import run_study
from lightning_hpz.study.study_config import load_study_config

STEPS, WARMUP = 5, 2
STUDY = {
    "name": "one_cell",
    "devices_per_node": 2,
    "steps": STEPS,
    "warmup_steps": WARMUP,
    "timeout_s": 400,
    "env": {"OMP_NUM_THREADS": "1"},
    "data": {"sequence_length": 32},
    "grid": {
        "models": ["llama2-tiny"],
        "strategies": ["hpz"],
        "micro_batch_sizes": [2],
        "hpz_partition_sizes": [2],
    },
}


def study(config, out):
    command = [sys.executable, "-m", "lightning_hpz.cli", "study", "--config", str(config), "--out", str(out)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=out.parent)


@pytest.fixture(scope="module")
def finished(module_tmp):
    config = module_tmp / "one_cell.yaml"
    config.write_text(yaml.safe_dump(STUDY))
    out = module_tmp / "out"
    first = study(config, out)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    return config, out, first


@pytest.mark.multiprocess
def test_a_real_cell_records_memory_speed_loss_and_the_prediction(finished):
    _, out, _ = finished
    (record,) = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert record["status"] == "ok", record["error"]
    assert record["cell_id"] == "llama2-tiny:hpz(2):mb2:32-true"
    assert len(record["memory_bytes_per_rank"]) == 2
    assert record["memory_method"] in ("rss_high_water_mark", "ru_maxrss")
    assert 0 < record["settled_bytes"] <= record["memory_bytes"]
    assert len(record["step_times_s"]) == STEPS - WARMUP and record["step_time_median_s"] > 0
    assert record["tokens_per_s"] > 0 and record["tflops_per_s_per_rank"] > 0
    losses = record["losses"]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    # fp32; ZeRO-3's reduce bucket counts as far as gradients filled it (the whole model: it is below 2e8 elements)
    planner = memory_per_rank(
        record["parameters"], ZeroSetup(3, 2), ClusterLayout(1, 2), 4, 12, 4, record["parameters"]
    )
    assert record["predicted"]["device_bytes"] == pytest.approx(planner.total)
    assert {p.name for p in out.glob("*.png")} == {
        "memory_per_rank.png",
        "throughput.png",
        "best_strategy.png",
        "loss_curves.png",
    }
    assert "| llama2-tiny |" in (out / "results.md").read_text()


@pytest.mark.multiprocess
def test_a_second_run_skips_the_finished_cell(finished):
    config, out, first = finished
    assert "[study]" in first.stdout + first.stderr  # the first run reported the cell it trained

    def must_not_run(spec, cell_dir):
        raise AssertionError(f"{spec['cell']} ran again")

    (record,) = run_study(load_study_config(config), out, runner=must_not_run, progress=False)
    assert record["status"] == "ok"
    assert len((out / "results.jsonl").read_text().splitlines()) == 1
