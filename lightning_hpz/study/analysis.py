"""What a study's records say, for the report and the plots alike: series per strategy, memory slopes, the best cell
per model size."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional

from lightning_hpz.study.cell_summary import fits

MIB = 2**20


def memory_slope(records: list[dict[str, Any]], key: str = "memory_bytes") -> Optional[tuple[float, float]]:
    """Least-squares line ``key`` = intercept + slope x parameters over ``records``: (bytes/param, intercept bytes)."""
    points = [(r["parameters"], r[key]) for r in records if r["status"] == "ok"]
    if len({p for p, _ in points}) < 2:
        return None
    mean_p = sum(p for p, _ in points) / len(points)
    mean_m = sum(m for _, m in points) / len(points)
    slope = sum((p - mean_p) * (m - mean_m) for p, m in points) / sum((p - mean_p) ** 2 for p, _ in points)
    return slope, mean_m - slope * mean_p


def series(records: list[dict[str, Any]]) -> dict[tuple[str, int, str], list[dict[str, Any]]]:
    """Records grouped by (strategy label, micro-batch, precision), each group ordered by model size."""
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        groups[(r["strategy_label"], r["micro_batch_size"], r["precision"])].append(r)
    return {key: sorted(group, key=lambda r: r["parameters"]) for key, group in groups.items()}


def best_by_size(records: list[dict[str, Any]], budget: Optional[float]) -> list[dict[str, Any]]:
    """Per (model, micro-batch, precision): the fastest and the leanest cell that fits, and how many fit."""
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        groups[(r["model"], r["micro_batch_size"], r["precision"])].append(r)
    rows = []
    for (model, micro_batch, precision), group in groups.items():
        fitting = [r for r in group if fits(r, budget)]
        rows.append(
            {
                "model": model,
                "parameters": group[0]["parameters"],
                "micro_batch_size": micro_batch,
                "precision": precision,
                "fastest": max(fitting, key=lambda r: r["tokens_per_s"]) if fitting else None,
                "leanest": min(fitting, key=lambda r: r["memory_bytes"]) if fitting else None,
                "fit": len(fitting),
                "cells": len(group),
            }
        )
    return sorted(rows, key=lambda row: (row["micro_batch_size"], row["precision"], row["parameters"]))
