"""The study's figures (matplotlib, Agg): memory per rank and throughput against model size per strategy, and the
fastest strategy that fits for each size (one panel per micro-batch size and precision), and the loss curves (one
panel per model size)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from lightning_hpz.study.analysis import MIB, best_by_size, series
from lightning_hpz.study.loss_agreement import loss_curves

MEMORY_PLOT, THROUGHPUT_PLOT, BEST_PLOT = "memory_per_rank.png", "throughput.png", "best_strategy.png"
LOSS_PLOT = "loss_curves.png"
# identical curves lie on top of each other: each strategy gets its own marker and dash so that all stay visible
_LINE_STYLES = (("o", "-"), ("s", "--"), ("^", "-."), ("x", ":"), ("d", "-"), ("v", "--"))


def write_plots(records: list[dict[str, Any]], out: Path, budget: Optional[float]) -> list[Path]:
    """Write the PNGs into ``out``; none when no cell trained (the loss curves only when cells recorded them)."""
    if not any(r["status"] == "ok" for r in records):
        return []
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster node
    plots = [
        _memory_plot(records, out / MEMORY_PLOT, budget),
        _throughput_plot(records, out / THROUGHPUT_PLOT),
        _best_plot(records, out / BEST_PLOT, budget),
    ]
    curves = loss_curves(records)
    return [*plots, _loss_plot(curves, out / LOSS_PLOT)] if curves else plots


def _panels(records: list[dict[str, Any]]) -> list[tuple[int, str]]:
    return sorted({(r["micro_batch_size"], r["precision"]) for r in records})


def _figure(panels: int, rows: int = 1) -> tuple[Any, list[list[Any]]]:
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(rows, panels, figsize=(6 * panels, 4.5 * rows), squeeze=False)
    return figure, [list(row) for row in axes]


def _size_axis(axis: Any) -> None:
    """Log scales with plain numbers (2, 5, 10, 50) rather than powers of ten."""
    from matplotlib.ticker import FuncFormatter

    axis.set(xscale="log", yscale="log")
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    for which in (axis.xaxis, axis.yaxis):
        which.set_major_formatter(plain)
        which.set_minor_formatter(plain)
    axis.tick_params(which="minor", labelsize=7)


def _save(figure: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path


# (record key, prediction key, what the row shows)
_MEMORY_ROWS = (
    ("memory_bytes", "device_bytes", "peak per rank (solid) vs planner at the optimizer step (dashed)"),
    ("settled_bytes", "between_steps_bytes", "after the last step (solid) vs planner between steps (dashed)"),
)


def _memory_plot(records: list[dict[str, Any]], path: Path, budget: Optional[float]) -> Path:
    panels = _panels(records)
    figure, axes = _figure(len(panels), rows=len(_MEMORY_ROWS))
    for row, (measured, predicted, title) in zip(axes, _MEMORY_ROWS, strict=True):
        for axis, (micro_batch, precision) in zip(row, panels, strict=True):
            for (label, mb, prec), group in series(records).items():
                if (mb, prec) != (micro_batch, precision):
                    continue
                ok = [r for r in group if r["status"] == "ok"]
                (line,) = axis.plot(
                    [r["parameters"] / 1e6 for r in ok], [r[measured] / MIB for r in ok], "o-", label=label
                )
                sizes = [r["parameters"] / 1e6 for r in group]
                axis.plot(
                    sizes, [r["predicted"][predicted] / MIB for r in group], "--", color=line.get_color(), alpha=0.6
                )
            if budget and measured == "memory_bytes":
                axis.axhline(budget / MIB, color="black", linewidth=0.8, linestyle=":", label="budget")
            _size_axis(axis)
            axis.set(xlabel="parameters (M)", ylabel="MiB per rank")
            axis.set_title(f"micro-batch {micro_batch}, {precision}: {title}", fontsize=9)
            axis.legend(fontsize=8)
    return _save(figure, path)


def _throughput_plot(records: list[dict[str, Any]], path: Path) -> Path:
    panels = _panels(records)
    figure, (axes,) = _figure(len(panels))
    for axis, (micro_batch, precision) in zip(axes, panels, strict=True):
        for (label, mb, prec), group in series(records).items():
            ok = [r for r in group if r["status"] == "ok"]
            if (mb, prec) == (micro_batch, precision) and ok:
                axis.plot([r["parameters"] / 1e6 for r in ok], [r["tokens_per_s"] for r in ok], "o-", label=label)
        _size_axis(axis)
        axis.set(xlabel="parameters (M)", ylabel="tokens/s (all ranks)")
        axis.set_title(f"throughput, micro-batch {micro_batch}, {precision}", fontsize=9)
        axis.legend(fontsize=8)
    return _save(figure, path)


def _best_plot(records: list[dict[str, Any]], path: Path, budget: Optional[float]) -> Path:
    panels = _panels(records)
    figure, (axes,) = _figure(len(panels))
    rows = best_by_size(records, budget)
    for axis, (micro_batch, precision) in zip(axes, panels, strict=True):
        chosen = [row for row in rows if (row["micro_batch_size"], row["precision"]) == (micro_batch, precision)]
        names = [row["model"] for row in chosen]
        speeds = [row["fastest"]["tokens_per_s"] if row["fastest"] else 0.0 for row in chosen]
        bars = axis.bar(range(len(chosen)), speeds, color="tab:blue")
        for bar, row in zip(bars, chosen, strict=True):
            label = row["fastest"]["strategy_label"] if row["fastest"] else "none fits"
            axis.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
        axis.set_xticks(range(len(chosen)), names, rotation=20, fontsize=8)
        axis.set(ylabel="tokens/s of the fastest strategy that fits")
        axis.set_title(f"best strategy per size, micro-batch {micro_batch}, {precision}", fontsize=9)
    return _save(figure, path)


def _loss_plot(curves: dict[tuple[str, int, str], dict[str, list[float]]], path: Path) -> Path:
    """One panel per model size (and micro-batch, precision): the loss of every step, one line per strategy."""
    import math

    columns = min(3, len(curves))
    rows = math.ceil(len(curves) / columns)
    figure, axes = _figure(columns, rows=rows)
    panels = [axis for row in axes for axis in row]
    for axis, ((model, micro_batch, precision), by_strategy) in zip(panels, curves.items(), strict=False):
        for (label, losses), (marker, dash) in zip(sorted(by_strategy.items()), _LINE_STYLES * 4, strict=False):
            steps = range(1, len(losses) + 1)
            axis.plot(steps, losses, marker=marker, linestyle=dash, markersize=4, label=label, alpha=0.8)
        axis.set(xlabel="optimizer step", ylabel="training loss (global batch)")
        axis.set_title(f"{model}, micro-batch {micro_batch}, {precision}", fontsize=9)
        axis.legend(fontsize=8)
    for axis in panels[len(curves) :]:
        axis.set_visible(False)
    return _save(figure, path)
