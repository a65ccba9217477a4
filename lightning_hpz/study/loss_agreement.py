"""Whether a study's strategies train the same model: the per-step losses of each model size, side by side.

With initial weights that depend on the seed alone (``initialize_by_name``), ZeRO-1, 2, 3 and hpZ train the same
model on the same batches; what may differ is the order in which gradients are summed (all-reduce against
reduce-scatter, bucket sizes), which moves the losses by rounding only. Each strategy's curve is compared with a
reference strategy of the same model, micro-batch and precision, step by step.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional

REFERENCE_ORDER = ("zero1", "zero2", "zero3")  # the first one present is the reference: the least sharded


def loss_curves(records: list[dict[str, Any]]) -> dict[tuple[str, int, str], dict[str, list[float]]]:
    """Per (model, micro-batch, precision), smallest model first: each trained strategy's per-step losses (the
    global batch's)."""
    curves: dict[tuple[str, int, str], dict[str, list[float]]] = defaultdict(dict)
    for r in sorted(records, key=lambda r: (r["micro_batch_size"], r["precision"], r["parameters"])):
        if r["status"] == "ok" and r.get("losses"):
            curves[(r["model"], r["micro_batch_size"], r["precision"])][r["strategy_label"]] = r["losses"]
    return dict(curves)


def reference_strategy(strategies: list[str]) -> str:
    return next((name for name in REFERENCE_ORDER if name in strategies), sorted(strategies)[0])


def largest_relative_gap(losses: list[float], reference: list[float]) -> float:
    """The largest |loss - reference| / |reference| over the steps both have (0.0 when they are identical)."""
    return max((abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=False)), default=0.0)


def falls(losses: list[float], window: int = 3) -> bool:
    """The mean of the last ``window`` losses is below the mean of the first ``window``: a trend, not one lucky
    batch (a short cell sees new data every step, so single losses are noisy)."""
    window = max(1, min(window, len(losses) // 2))
    return len(losses) >= 2 and sum(losses[-window:]) / window < sum(losses[:window]) / window


def agreement(records: list[dict[str, Any]], tolerance: float) -> list[dict[str, Any]]:
    """One row per model size: the reference, each strategy's largest gap to it, whether every gap is within
    ``tolerance`` and whether every curve falls."""
    rows = []
    for (model, micro_batch, precision), curves in loss_curves(records).items():
        reference = reference_strategy(list(curves))
        gaps = {name: largest_relative_gap(losses, curves[reference]) for name, losses in curves.items()}
        worst: Optional[float] = max((g for name, g in gaps.items() if name != reference), default=None)
        rows.append(
            {
                "model": model,
                "micro_batch_size": micro_batch,
                "precision": precision,
                "reference": reference,
                "first_loss": curves[reference][0],
                "last_loss": curves[reference][-1],
                "gaps": gaps,
                "worst_gap": worst,
                "agree": worst is None or worst <= tolerance,
                "all_fall": all(falls(losses) for losses in curves.values()),
            }
        )
    return rows
