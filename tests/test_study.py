"""``lightning-hpz study`` without training: config validation, grid expansion, resumption, failed cells, the report.

Cells run through a fake runner that returns made-up rank records at once, so the study's own logic costs
milliseconds; tests/test_study_cell.py trains one real cell.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import yaml

from lightning_hpz.planning import ClusterLayout, ZeroSetup, memory_per_rank
from lightning_hpz.study.analysis import best_by_size, memory_slope
from lightning_hpz.study.cell_runner import FAILED, OK, CellRun
from lightning_hpz.study.command import run_study, study_main
from lightning_hpz.study.grid import expand_grid
from lightning_hpz.study.loss_agreement import agreement, falls
from lightning_hpz.study.prediction import predicted_memory
from lightning_hpz.study.report import write_report
from lightning_hpz.study.results_log import RESULTS_FILE, StudyResumeError, read_results
from lightning_hpz.study.study_config import StudyConfigError, load_study_config, parse_study_config

REPO = Path(__file__).resolve().parents[1]


def study_dict(**overrides) -> dict:
    """A valid study over three families' tiny presets; ``grid`` entries override the grid's axes."""
    given = overrides.pop("grid", {})
    grid = {
        "models": ["t5-tiny", "llama2-tiny", "falcon-tiny"],
        "strategies": ["zero1", "zero3", "hpz"],
        "micro_batch_sizes": [1, 4],
        **given,
    }
    if "hpz" in grid["strategies"] and "hpz_partition_sizes" not in given:
        grid["hpz_partition_sizes"] = [2]
    return {"name": "unit", "devices_per_node": 2, "steps": 5, "warmup_steps": 2, **overrides, "grid": grid}


class FakeRunner:
    """Returns a trained cell whose memory grows by ``bytes_per_param`` x parameters; records every call."""

    def __init__(self, fail: tuple[str, ...] = (), raise_for: tuple[str, ...] = (), interrupt_after: int = -1):
        self.calls: list[str] = []
        self.fail, self.raise_for, self.interrupt_after = fail, raise_for, interrupt_after

    def __call__(self, spec: dict, cell_dir: Path) -> CellRun:
        cell = spec["cell"]
        cell_id = f"{cell['model']}:{cell['strategy']}:mb{cell['micro_batch_size']}"
        if len(self.calls) == self.interrupt_after:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the study
        self.calls.append(cell_id)
        if cell_id in self.raise_for:
            raise RuntimeError("launcher exploded")
        if cell_id in self.fail:
            return CellRun(FAILED, error="rank 1: RuntimeError: boom")
        stage_bytes = {"zero1": 9000, "zero3": 3000, "hpz": 4000}[cell["strategy"]]
        ranks = [self._rank(r, stage_bytes * cell["micro_batch_size"], cell["micro_batch_size"]) for r in (0, 1)]
        return CellRun(OK, ranks, wall_s=0.1)

    @staticmethod
    def _rank(rank: int, memory: int, micro_batch: int) -> dict:
        return {
            "rank": rank,
            "losses": [5.0, 4.0, 3.0 + rank],
            "step_times": [0.5, 1.0 + rank, 0.5],
            "measured_tokens": 100 * micro_batch,
            "measured_flops": 1e9,
            "memory": {
                "method": "fake",
                "baseline_bytes": 1000,
                "peak_bytes": 1000 + memory + rank,
                "settled_bytes": 1000 + memory // 2,
            },
        }


# ------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"grid": {"models": ["t5-huge"]}}, "unknown model(s) ['t5-huge']"),
        ({"grid": {"strategies": ["zero4"]}}, "unknown strategy ['zero4']"),
        ({"grid": {"micro_batch_sizes": []}}, "grid.micro_batch_sizes must be a non-empty list"),
        ({"grid": {"micro_batch_sizes": [0]}}, "grid.micro_batch_sizes=0 must be a positive whole number"),
        ({"grid": {"precisions": ["8-true"]}}, "grid.precisions='8-true' is not one of"),
        ({"grid": {"hpz_partition_sizes": [3]}}, "grid.hpz_partition_sizes [3]"),
        ({"grid": {"hpz_partition_sizes": None}}, "'auto' turns hpZ off there"),
        ({"grid": {"strategies": ["zero2"], "hpz_partition_sizes": [2]}}, "no strategy in the grid uses hpZ"),
        ({"grid": {"strategies": ["zeropp"]}}, "zeropp quantizes with CUDA kernels only"),
        ({"stages": [1, 2]}, "Unknown key(s) ['stages'] in the study config"),
        ({"steps": 3, "warmup_steps": 2}, "leaves 1 measured steps"),
        ({"nodes": 2}, "a multi-node cell needs a `launcher:`"),
        ({"lr_warmup_steps": 5}, "lr_warmup_steps=5 is not below steps=5"),
        ({"lr_warmup_steps": -1}, "lr_warmup_steps=-1 must be a whole number, 0 or more"),
        ({"lr_min_ratio": 1.5}, "lr_min_ratio=1.5: the final learning rate is a share of the peak"),
        ({"launcher": ["srun", "python", "-m", "lightning_hpz.study.worker"]}, "has no '{spec}' item"),
        ({"models": {"t5-tiny": {"family": "t5", "config": {}}}}, "a preset has that name"),
        ({"models": {"mine": {"family": "gpt", "config": {}}}}, "models.mine.family='gpt' is not one of"),
    ],
)
def test_malformed_config_is_refused_with_what_to_fix(change, message):
    raw = study_dict(**change)
    if raw["grid"].get("hpz_partition_sizes", "absent") is None:
        raw["grid"].pop("hpz_partition_sizes")
    with pytest.raises(StudyConfigError) as caught:
        parse_study_config(raw)
    assert message in str(caught.value)


def test_command_refuses_a_malformed_file_before_running_anything(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(study_dict(grid={"models": []})))
    with pytest.raises(SystemExit) as stopped:
        study_main(["--config", str(path), "--out", str(tmp_path / "out")])
    assert stopped.value.code == 2
    assert "grid.models must be a non-empty list" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_shipped_study_configs_parse():
    for name in ("cpu_small", "seed2_t5_gpu"):
        config = load_study_config(REPO / "configs" / "study" / f"{name}.yaml")
        assert expand_grid(config), name


# ------------------------------------------------------------------------------------------------- grid
def test_grid_is_the_product_with_hpz_sizes_only_on_hpz_strategies():
    config = parse_study_config(study_dict(devices_per_node=4, grid={"hpz_partition_sizes": [2, 4]}))
    cells = expand_grid(config)
    # 3 models x 2 micro-batches x (zero1 + zero3 + hpz at 2 sizes)
    assert len(cells) == 3 * 2 * 4
    assert len({c.cell_id for c in cells}) == len(cells)
    assert {c.hpz_partition_size for c in cells if c.strategy != "hpz"} == {1}
    assert {c.strategy_label for c in cells if c.strategy == "hpz"} == {"hpz(2)", "hpz(4)"}
    assert [c.model for c in cells[:8]] == ["t5-tiny"] * 8  # model-major: a size's cells run together


def test_hpz_on_several_nodes_defaults_to_the_devices_per_node():
    launcher = ["srun", "python", "-m", "lightning_hpz.study.worker", "{spec}"]
    raw = study_dict(nodes=2, devices_per_node=8, launcher=launcher)
    del raw["grid"]["hpz_partition_sizes"]
    config = parse_study_config(raw)
    assert {c.hpz_partition_size for c in expand_grid(config) if c.strategy == "hpz"} == {8}


# ------------------------------------------------------------------------------------------------- running
def test_second_run_skips_finished_cells_and_runs_only_new_ones(tmp_path):
    config = parse_study_config(study_dict())
    first = FakeRunner()
    records = run_study(config, tmp_path, runner=first, progress=False)
    assert len(first.calls) == len(expand_grid(config)) == len(records)
    again = FakeRunner()
    assert run_study(config, tmp_path, runner=again, progress=False) == records
    assert again.calls == []
    wider = parse_study_config(study_dict(grid={"micro_batch_sizes": [1, 4, 8]}))
    third = FakeRunner()
    run_study(wider, tmp_path, runner=third, progress=False)
    assert sorted(third.calls) == sorted(c.replace(":mb1", ":mb8") for c in first.calls if c.endswith(":mb1"))
    assert len(read_results(tmp_path)) == len(expand_grid(wider))


def test_interrupted_study_resumes_where_it_stopped(tmp_path):
    config = parse_study_config(study_dict())
    with pytest.raises(KeyboardInterrupt):
        run_study(config, tmp_path, runner=FakeRunner(interrupt_after=5), progress=False)
    assert len(read_results(tmp_path)) == 5
    rest = FakeRunner()
    records = run_study(config, tmp_path, runner=rest, progress=False)
    assert len(rest.calls) == len(expand_grid(config)) - 5
    assert [r["cell_id"] for r in records] == [c.cell_id for c in expand_grid(config)]


def test_failing_cells_are_recorded_and_the_study_goes_on(tmp_path):
    config = parse_study_config(study_dict())
    runner = FakeRunner(fail=("llama2-tiny:zero1:mb1",), raise_for=("t5-tiny:hpz:mb4",))
    records = run_study(config, tmp_path, runner=runner, progress=False)
    by_status = {r["cell_id"]: r for r in records if r["status"] != OK}
    assert sorted(by_status) == ["llama2-tiny:zero1:mb1:32-true", "t5-tiny:hpz(2):mb4:32-true"]
    assert "boom" in by_status["llama2-tiny:zero1:mb1:32-true"]["error"]
    assert "RuntimeError: launcher exploded" in by_status["t5-tiny:hpz(2):mb4:32-true"]["error"]
    assert runner.calls[-1] == "falcon-tiny:hpz:mb4"  # cells after the failures still ran
    report = write_report(config, records, tmp_path)
    assert "## Cells that did not train" in report.markdown and "launcher exploded" in report.markdown
    retry = FakeRunner()
    run_study(config, tmp_path, runner=retry, retry_failed=True, progress=False)
    assert sorted(retry.calls) == ["llama2-tiny:zero1:mb1", "t5-tiny:hpz:mb4"]


def test_results_of_other_settings_are_not_mixed_in(tmp_path):
    run_study(parse_study_config(study_dict()), tmp_path, runner=FakeRunner(), progress=False)
    with pytest.raises(StudyResumeError, match="measured with other settings"):
        run_study(parse_study_config(study_dict(steps=9)), tmp_path, runner=FakeRunner(), progress=False)


def test_a_line_cut_short_by_a_kill_is_run_again(tmp_path):
    config = parse_study_config(study_dict(grid={"models": ["t5-tiny"], "strategies": ["zero1"]}))
    run_study(config, tmp_path, runner=FakeRunner(), progress=False)
    lines = (tmp_path / RESULTS_FILE).read_text().splitlines()
    (tmp_path / RESULTS_FILE).write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])
    again = FakeRunner()
    run_study(config, tmp_path, runner=again, progress=False)
    assert again.calls == ["t5-tiny:zero1:mb4"]


# ------------------------------------------------------------------------------------------------- metrics, report
def test_cell_metrics_come_from_the_slowest_rank_and_the_largest_memory(tmp_path):
    config = parse_study_config(study_dict(grid={"models": ["t5-tiny"], "strategies": ["zero3"]}))
    record = run_study(config, tmp_path, runner=FakeRunner(), progress=False)[0]
    assert record["step_times_s"] == [0.5, 2.0, 0.5]  # rank 1's slow middle step
    assert record["step_time_spread"] == pytest.approx((2.0 - 0.5) / 0.5)
    assert record["tokens_per_s"] == pytest.approx(2 * 100 / 3.0)
    assert record["memory_bytes"] == 3000 + 1  # rank 1 peaks one byte higher
    assert record["final_loss"] == pytest.approx((3.0 + 4.0) / 2)
    assert record["measured_over_predicted"] == pytest.approx(3001 / record["predicted"]["device_bytes"])


def test_memory_slope_cancels_the_fixed_part():
    records = [
        {"status": OK, "parameters": p, "memory_bytes": 300e6 + 14 * p} for p in (1_000_000, 5_000_000, 20_000_000)
    ]
    slope, intercept = memory_slope(records)
    assert slope == pytest.approx(14) and intercept == pytest.approx(300e6)


def test_best_strategy_per_size_is_the_fastest_that_fits_the_budget(tmp_path):
    config = parse_study_config(study_dict(grid={"models": ["t5-tiny"], "micro_batch_sizes": [1]}))
    records = run_study(config, tmp_path, runner=FakeRunner(), progress=False)
    speeds = {"zero1": 30.0, "zero3": 10.0, "hpz(2)": 20.0}
    for record in records:
        record["tokens_per_s"] = speeds[record["strategy_label"]]
    (row,) = best_by_size(records, budget=None)
    assert row["fastest"]["strategy_label"] == "zero1" and row["leanest"]["strategy_label"] == "zero3"
    (row,) = best_by_size(records, budget=5000)  # zero1's 9001 bytes do not fit
    assert row["fastest"]["strategy_label"] == "hpz(2)" and row["fit"] == 2


def test_report_writes_the_tables_and_four_plots(tmp_path):
    config = parse_study_config(study_dict(memory_budget_gib=1.0))
    records = run_study(config, tmp_path, runner=FakeRunner(), progress=False)
    report = write_report(config, records, tmp_path)
    markdown = (tmp_path / "results.md").read_text()
    assert markdown == report.markdown
    # six cells, and the best-per-size and loss rows of two micro-batches
    assert markdown.count("| t5-tiny |") == 6 + 2 + 2
    assert sorted(p.name for p in report.plots) == [
        "best_strategy.png", "loss_curves.png", "memory_per_rank.png", "throughput.png"
    ]  # fmt: skip
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in report.plots)
    # every strategy of the fake runner reports the same falling losses: the verdict says they agree
    assert "**All sizes fall and agree: yes.**" in markdown


def test_losses_are_the_global_batch_mean_per_step_and_a_gap_is_flagged(tmp_path):
    config = parse_study_config(study_dict(grid={"models": ["t5-tiny"], "micro_batch_sizes": [1]}))
    records = run_study(config, tmp_path, runner=FakeRunner(), progress=False)
    assert records[0]["losses"] == [5.0, 4.0, 3.5]  # ranks 0 and 1 end at 3.0 and 4.0
    hpz = next(r for r in records if r["strategy"] == "hpz")
    hpz["losses"] = [5.0, 4.0, 3.5 * (1 + 2e-3)]  # beyond the default tolerance of 1e-3
    (row,) = agreement(records, config.loss_tolerance)
    assert row["reference"] == "zero1" and row["gaps"]["zero3"] == 0.0
    assert row["gaps"]["hpz(2)"] == pytest.approx(2e-3) and not row["agree"] and row["all_fall"]
    markdown = write_report(config, records, tmp_path).markdown
    assert "hpz(2) 2.0e-03" in markdown and "**All sizes fall and agree: no.**" in markdown


def test_a_curve_falls_on_its_trend_not_on_one_batch():
    assert falls([9.0, 8.0, 8.5, 7.0, 7.5, 6.0])
    assert not falls([9.0, 6.0, 9.5, 9.0, 8.0, 9.8])  # the last batch is lower than the first, the trend is not
    assert not falls([5.0])


def test_prediction_moves_offloaded_states_to_the_host_on_gpu_only():
    raw = study_dict(grid={"strategies": ["zero2_offload", "zero2"]})
    cpu, gpu = parse_study_config(raw), parse_study_config({**raw, "accelerator": "gpu"})
    cells = {cell.strategy: cell for cell in expand_grid(cpu)}
    offload, plain = cells["zero2_offload"], cells["zero2"]
    assert predicted_memory(offload, cpu, 10**6) == predicted_memory(plain, cpu, 10**6)
    on_gpu = predicted_memory(offload, gpu, 10**6)
    assert on_gpu["host_bytes"] == on_gpu["optimizer_states_bytes"] == 12 * 10**6 / 2
    assert on_gpu["device_bytes"] == predicted_memory(plain, gpu, 10**6)["device_bytes"] - on_gpu["host_bytes"]


# ------------------------------------------------------------------------------------------------- imports
DRIVER_MODULES = ("command", "study_config", "grid", "cell_strategy", "cell_runner", "cell_summary", "prediction",
                  "results_log", "report", "plots", "analysis", "loss_agreement")  # fmt: skip
HEAVY = ("torch", "lightning", "deepspeed", "transformers", "matplotlib", "lightning_hpz.models", "lightning_hpz.data")


@pytest.mark.parametrize("module", DRIVER_MODULES)
def test_study_tool_modules_import_nothing_heavy_at_top_level(module):
    tree = ast.parse((REPO / "lightning_hpz" / "study" / f"{module}.py").read_text())
    for node in tree.body:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        assert not [n for n in names if any(n == h or n.startswith(h + ".") for h in HEAVY)], (module, names)


def test_results_are_json_lines(tmp_path):
    config = parse_study_config(study_dict(grid={"models": ["t5-tiny"], "strategies": ["zero1"]}))
    run_study(config, tmp_path, runner=FakeRunner(), progress=False)
    lines = (tmp_path / RESULTS_FILE).read_text().splitlines()
    assert [json.loads(line)["cell_id"] for line in lines] == [c.cell_id for c in expand_grid(config)]


def test_planner_counts_zero3s_reduce_bucket_and_what_is_freed_after_the_step():
    layout, params = ClusterLayout(1, 2), 10**6
    zero2 = memory_per_rank(params, ZeroSetup(2), layout, 4, 12, 4, reduce_bucket_elements=2e8)
    assert zero2.reduce_buckets == 0  # stages 1-2 allocate their buckets during backward only
    assert zero2.between_steps == zero2.parameters + zero2.optimizer_states  # gradients are dropped after the step
    hpz = memory_per_rank(params, ZeroSetup(3, 2), layout, 4, 12, 4, reduce_bucket_elements=2e8)
    assert hpz.reduce_buckets == 2e8 * 4
    assert hpz.between_steps == hpz.total - hpz.secondary_shards  # ZeRO-3 keeps its gradient partitions
    raw = study_dict(grid={"models": ["t5-tiny"], "strategies": ["zero3"], "micro_batch_sizes": [1]})
    (cell,) = expand_grid(parse_study_config(raw))
    on_cpu = predicted_memory(cell, parse_study_config(raw), params)
    on_gpu = predicted_memory(cell, parse_study_config({**raw, "accelerator": "gpu"}), params)
    # a CPU's resident set holds the bucket pages gradients were written to; a GPU allocates all of it
    assert on_cpu["reduce_buckets_bytes"] == params * 4 and on_gpu["reduce_buckets_bytes"] == 2e8 * 4
