"""``lightning-hpz study --config configs/study/NAME.yaml [--out DIR]``: run every cell of a scaling study.

Each cell trains in its own processes; its result line is appended to ``DIR/results.jsonl`` as soon as it ends, so an
interrupted study resumes where it stopped. At the end ``DIR/results.md`` (tables) and ``DIR/*.png`` (plots) are
written from all lines.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from lightning_hpz.study.cell_runner import FAILED, CellRun, CellRunner, SubprocessCellRunner
from lightning_hpz.study.cell_summary import summarize_cell, with_prediction
from lightning_hpz.study.grid import StudyCell, expand_grid
from lightning_hpz.study.prediction import predicted_memory
from lightning_hpz.study.results_log import StudyResumeError, append_result, finished_cells, read_results
from lightning_hpz.study.study_config import StudyConfig, StudyConfigError, load_study_config


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="lightning-hpz study",
        description="Run every cell of a scaling study (model x ZeRO strategy x micro-batch, from a YAML grid), each "
        "in its own processes; results are appended to OUT/results.jsonl (a rerun resumes), then OUT/results.md and "
        "plots are written. See docs/scaling-study.md.",
    )
    parser.add_argument("--config", type=Path, required=True, help="study YAML, e.g. configs/study/cpu_small.yaml")
    parser.add_argument("--out", type=Path, help="results folder (default runs/study/<config name>)")
    parser.add_argument("--retry-failed", action="store_true", help="run again the cells recorded as not ok")
    parser.add_argument("--report-only", action="store_true", help="only rewrite results.md and plots from the lines")
    return parser.parse_args(list(argv))


def study_main(argv: Sequence[str] = ()) -> None:
    args = parse_args(argv)
    try:
        config = load_study_config(args.config)
        out = args.out or Path("runs/study") / config.name
        records = run_study(config, out, retry_failed=args.retry_failed, run_cells=not args.report_only)
    except (StudyConfigError, StudyResumeError) as err:
        print(f"lightning-hpz study: {err}", file=sys.stderr)
        raise SystemExit(2) from err
    from lightning_hpz.study.report import write_report

    report = write_report(config, records, out)
    print(report.table)
    print(f"results in {out}: results.jsonl, results.md, " + ", ".join(p.name for p in report.plots))


def run_study(
    config: StudyConfig,
    out: Path,
    runner: Optional[CellRunner] = None,
    retry_failed: bool = False,
    run_cells: bool = True,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Run the cells that have no result yet; return the latest result of every cell, in grid order."""
    cells = expand_grid(config)
    fingerprint = config.fingerprint()
    done = finished_cells(read_results(out), fingerprint, retry_failed)
    todo = [cell for cell in cells if cell.cell_id not in done] if run_cells else []
    runner = runner or SubprocessCellRunner(config)
    with _progress_bar(len(cells), len(cells) - len(todo), progress) as bar:
        for cell in todo:
            bar.set_postfix_str(f"{cell.cell_id}, {bar.total - bar.n} left")
            record = run_cell(config, cell, out, runner)
            append_result(out, record)
            done[cell.cell_id] = record
            bar.update()
            bar.write(f"[study] {cell.cell_id}: {_outcome(record)}")
    return [_with_current_prediction(config, cell, done[cell.cell_id]) for cell in cells if cell.cell_id in done]


def _with_current_prediction(config: StudyConfig, cell: StudyCell, record: dict[str, Any]) -> dict[str, Any]:
    return with_prediction(record, predicted_memory(cell, config, record["parameters"]))


def run_cell(config: StudyConfig, cell: StudyCell, out: Path, runner: CellRunner) -> dict[str, Any]:
    """Train ``cell`` with ``runner``; a runner that raises is recorded as a failed cell, and the study goes on."""
    cell_dir = out / "cells" / re.sub(r"[^A-Za-z0-9.-]+", "_", cell.cell_id)
    try:
        run = runner(cell_spec(config, cell, out, cell_dir), cell_dir)
    except Exception as err:
        run = CellRun(FAILED, error=f"the cell runner raised {type(err).__name__}: {err}")
    parameters = parameter_count(config, cell.model)
    return summarize_cell(cell, run, parameters, predicted_memory(cell, config, parameters), config.fingerprint())


def cell_spec(config: StudyConfig, cell: StudyCell, out: Path, cell_dir: Path) -> dict[str, Any]:
    """Everything the worker needs, as JSON (see :mod:`lightning_hpz.study.worker`)."""
    return {
        "cell": cell.to_dict(),
        "model": model_definition(config, cell.model),
        "accelerator": config.accelerator,
        "devices_per_node": config.devices_per_node,
        "nodes": config.nodes,
        "steps": config.steps,
        "warmup_steps": config.warmup_steps,
        "learning_rate": config.learning_rate,
        "lr_warmup_steps": config.lr_warmup_steps,
        "lr_min_ratio": config.lr_min_ratio,
        "activation_checkpointing": config.activation_checkpointing,
        "data": config.data,
        "deepspeed_config": config.deepspeed_config,
        "token_cache": str((out / "token_cache").resolve()),
        "out": str(cell_dir.resolve()),
    }


def model_definition(config: StudyConfig, name: str) -> dict[str, Any]:
    if name in config.models:
        model = config.models[name]
        return {"name": name, "family": model.family, "config": model.config}
    from lightning_hpz.models.presets import get_preset

    preset = get_preset(name)
    return {"name": name, "family": preset.family, "config": preset.config}


def parameter_count(config: StudyConfig, name: str) -> int:
    """Exact parameter count, from the architecture built on the meta device."""
    from lightning_hpz.models.presets import ModelPreset, count_parameters

    if name not in config.models:
        return count_parameters(name)
    model = config.models[name]
    return count_parameters(ModelPreset(name, model.family, model.config, parameters=0, headline="", source=""))


def _outcome(record: dict[str, Any]) -> str:
    if record["status"] != "ok":
        return f"{record['status'].upper()}: {record['error']}"
    return (
        f"ok, {record['memory_bytes'] / 2**20:.0f} MiB/rank measured, {record['predicted']['device_bytes'] / 2**20:.0f}"
        f" MiB predicted, {record['tokens_per_s']:.0f} tokens/s, loss {record['final_loss']:.3f}, {record['wall_s']} s"
    )


class _NoBar:
    """Stands in for tqdm when no progress bar is wanted (tests)."""

    def __init__(self, total: int, initial: int) -> None:
        self.total, self.n = total, initial

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def update(self) -> None:
        self.n += 1

    def write(self, text: str) -> None:
        pass


def _progress_bar(total: int, initial: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar(total, initial)
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="cell", desc="study", file=sys.stderr, dynamic_ncols=True)
