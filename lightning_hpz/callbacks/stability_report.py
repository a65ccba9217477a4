"""The stability summary (JSON) and the loss-curve plot with events marked, written at the end of training."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_hpz.callbacks.stability_detection import (
    DIVERGENCE,
    GRAD_NORM_SPIKE,
    LOSS_SPIKE,
    NONFINITE_LOSS,
    StabilityEvent,
)

_MARKERS = {LOSS_SPIKE: ("^", "tab:orange"), NONFINITE_LOSS: ("x", "tab:red"), GRAD_NORM_SPIKE: ("v", "tab:purple")}


def stability_summary(
    events: Sequence[StabilityEvent],
    max_loss_zscore: float,
    max_grad_norm_zscore: float,
    rollbacks: Sequence[dict[str, Any]],
    skipped: Sequence[dict[str, Any]],
    stop_checkpoint: str | None,
    steps_observed: int,
    updates_dropped_by_engine: int | None = None,
) -> dict[str, Any]:
    def count(kind: str) -> int:
        return sum(e.kind == kind for e in events)

    return {
        "steps_observed": steps_observed,
        "nonfinite_losses": count(NONFINITE_LOSS),
        "loss_spikes": count(LOSS_SPIKE),
        "grad_norm_spikes": count(GRAD_NORM_SPIKE),
        "divergences": count(DIVERGENCE),
        "max_loss_zscore": round(max_loss_zscore, 3),
        "max_grad_norm_zscore": round(max_grad_norm_zscore, 3),
        "rollbacks": list(rollbacks),
        "skipped_batches": list(skipped),
        # what really happened: DeepSpeed's overflow guard can drop updates the monitor did not ask it to (None when
        # the strategy is not DeepSpeed's)
        "updates_dropped_by_engine": updates_dropped_by_engine,
        "stopped": stop_checkpoint is not None,
        "stop_checkpoint": stop_checkpoint,
        "events": [{"kind": e.kind, "step": e.step, "value": _json_float(e.value), "zscore": e.zscore} for e in events],
    }


def _json_float(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)  # JSON has no NaN/Inf


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2))


def plot_loss_curve(
    path: Path,
    losses: Sequence[tuple[int, float]],
    events: Sequence[StabilityEvent],
    rollback_steps: Sequence[int],
) -> None:
    """Loss per optimizer step; spikes, non-finite losses (drawn at the plot's top) and rollbacks marked."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a training node
    import matplotlib.pyplot as plt

    finite = [(s, v) for s, v in losses if math.isfinite(v)]
    figure, axes = plt.subplots(figsize=(8, 4))
    if finite:
        axes.plot([s for s, _ in finite], [v for _, v in finite], color="tab:blue", linewidth=1, label="loss")
    top = max((v for _, v in finite), default=1.0)
    for kind, (marker, color) in _MARKERS.items():
        hits = [e for e in events if e.kind == kind]
        if hits:
            ys = [e.value if math.isfinite(e.value) and kind != GRAD_NORM_SPIKE else top for e in hits]
            axes.scatter([e.step for e in hits], ys, marker=marker, color=color, zorder=3, label=kind.replace("_", " "))
    for i, step in enumerate(rollback_steps):
        axes.axvline(step, color="tab:green", linestyle="--", linewidth=1, label="rollback" if i == 0 else None)
    for e in (e for e in events if e.kind == DIVERGENCE):
        axes.axvline(e.step, color="tab:brown", linestyle=":", linewidth=1)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("loss (mean over ranks)")
    axes.legend(loc="upper right", fontsize="small")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
