"""One result line per cell: the ranks' records reduced to the study's metrics, beside the planner's prediction."""

from __future__ import annotations

import statistics
from typing import Any, Optional

from lightning_hpz.study.cell_runner import OK, CellRun
from lightning_hpz.study.grid import StudyCell


def summarize_cell(
    cell: StudyCell, run: CellRun, parameters: int, prediction: dict[str, Any], fingerprint: str
) -> dict[str, Any]:
    """The JSON line of ``cell``: settings, outcome, and (when it trained) memory, speed and loss."""
    record: dict[str, Any] = {
        "cell_id": cell.cell_id,
        **cell.to_dict(),
        "strategy_label": cell.strategy_label,
        "parameters": parameters,
        "fingerprint": fingerprint,
        "status": run.status,
        "error": run.error,
        "wall_s": round(run.wall_s, 1),
        "log": run.log,
    }
    if run.status == OK and run.ranks:
        record.update(_memory(run.ranks))
        record.update(_speed(run.ranks))
        # the global batch's loss per step: every rank's micro-batch has the same size, so the mean of the ranks'
        record["losses"] = [statistics.fmean(step) for step in zip(*(r["losses"] for r in run.ranks), strict=True)]
        record["final_loss"] = record["losses"][-1]
    return with_prediction(record, prediction)


def with_prediction(record: dict[str, Any], prediction: dict[str, Any]) -> dict[str, Any]:
    """``record`` with the planner's ``prediction`` and the measured/predicted ratios (recomputed for a report, so
    that a study measured before a planner change is compared with the current planner)."""
    record = {**record, "predicted": prediction}
    if record["status"] == OK and "memory_bytes" in record:
        record["measured_over_predicted"] = record["memory_bytes"] / prediction["device_bytes"]
        record["settled_over_predicted"] = record["settled_bytes"] / prediction["between_steps_bytes"]
    return record


def _memory(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Peak above the baseline per rank; the largest one is what a rank needs (``memory_bytes``)."""
    increments = [r["memory"]["peak_bytes"] - r["memory"]["baseline_bytes"] for r in ranks]
    settled = max(r["memory"]["settled_bytes"] - r["memory"]["baseline_bytes"] for r in ranks)
    return {
        "memory_method": ranks[0]["memory"]["method"],
        "memory_bytes": max(increments),
        "settled_bytes": settled,
        "memory_bytes_per_rank": increments,
        "baseline_bytes_per_rank": [r["memory"]["baseline_bytes"] for r in ranks],
        "peak_bytes_per_rank": [r["memory"]["peak_bytes"] for r in ranks],
    }


def _speed(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """A step ends when its slowest rank ends it, so step times are the maximum over ranks."""
    steps = [max(times) for times in zip(*(r["step_times"] for r in ranks), strict=True)]
    window = sum(steps)
    median = statistics.median(steps)
    return {
        "step_times_s": steps,
        "step_time_median_s": median,
        "step_time_spread": (max(steps) - min(steps)) / median if median else None,
        "tokens_per_s": sum(r["measured_tokens"] for r in ranks) / window,
        "tflops_per_s_per_rank": statistics.fmean(r["measured_flops"] for r in ranks) / window / 1e12,
    }


def fits(record: dict[str, Any], budget_bytes: Optional[float]) -> bool:
    """Trained, and (with a budget) within it."""
    if record["status"] != OK:
        return False
    return budget_bytes is None or record["memory_bytes"] <= budget_bytes
