"""The study's markdown report: every cell, measured memory against the planner's, and the best strategy per size."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from lightning_hpz.study.analysis import MIB, best_by_size, memory_slope, series
from lightning_hpz.study.loss_agreement import agreement
from lightning_hpz.study.plots import write_plots
from lightning_hpz.study.study_config import StudyConfig

REPORT_FILE = "results.md"


@dataclass
class StudyReport:
    table: str
    markdown: str
    plots: list[Path] = field(default_factory=list)


def write_report(config: StudyConfig, records: list[dict[str, Any]], out: Path) -> StudyReport:
    """Write ``results.md`` and the plots into ``out`` and return them."""
    out.mkdir(parents=True, exist_ok=True)
    budget = config.memory_budget_gib * 2**30 if config.memory_budget_gib else None
    table = cells_table(records)
    sections = [
        f"# Scaling study `{config.name}`",
        config.description.strip(),
        setup_lines(config, records),
        "## Cells",
        table,
        "## Memory per rank: measured against the planner",
        "Slopes are least-squares fits over the model sizes: the fixed costs (engine buffers, communication "
        "workspaces, code loaded during the first step) cancel in them, and what grows with the model remains.",
        slopes_table(records),
        "## Best strategy per model size",
        best_table(records, budget),
        "## Losses: do the strategies train the same model?",
        losses_section(records, config.loss_tolerance),
    ]
    failures = failures_list(records)
    if failures:
        sections += ["## Cells that did not train", failures]
    plots = write_plots(records, out, budget)
    sections += ["## Plots", "\n".join(f"![{p.stem}]({p.name})" for p in plots)]
    markdown = "\n\n".join(s for s in sections if s) + "\n"
    (out / REPORT_FILE).write_text(markdown)
    return StudyReport(table, markdown, plots)


def setup_lines(config: StudyConfig, records: list[dict[str, Any]]) -> str:
    methods = sorted({r["memory_method"] for r in records if "memory_method" in r})
    lines = [
        f"- {config.nodes} node(s) x {config.devices_per_node} {config.accelerator} device(s); {config.steps} steps "
        f"per cell, the first {config.warmup_steps} not measured; data: {config.data}.",
        f"- Memory per rank = peak - baseline, the baseline taken once the data is ready and before the model is "
        f"built (method: {', '.join(methods) or 'none yet'}); the largest rank's value. Predicted at step = the "
        "planner's model states on the device at the optimizer step (parameters, gradients, optimizer states, hpZ "
        "secondary shards, ZeRO-3's reduce bucket); between steps = without what DeepSpeed frees after each step.",
        "- tokens/s: real tokens of all ranks over the measured steps; a step's time is its slowest rank's. "
        "Spread = (slowest - fastest step) / median step.",
    ]
    if config.memory_budget_gib:
        budget = config.memory_budget_gib
        lines.append(f"- A cell fits when it trained and its memory per rank is at most {budget} GiB.")
    return "\n".join(lines)


def _fmt(value: Optional[float], digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def cells_table(records: list[dict[str, Any]]) -> str:
    header = (
        "| model | params (M) | strategy | micro-batch | precision | status | peak/rank (MiB) | predicted at step "
        "| peak/predicted | after last step (MiB) | predicted between steps | after/predicted | tokens/s "
        "| TFLOP/s/rank | step (s, median) | spread | final loss |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in records:
        ok = r["status"] == "ok"
        cells = [
            r["model"],
            _fmt(r["parameters"] / 1e6, 2),
            r["strategy_label"],
            str(r["micro_batch_size"]),
            r["precision"],
            r["status"],
            _fmt(r["memory_bytes"] / MIB) if ok else "-",
            _fmt(r["predicted"]["device_bytes"] / MIB),
            _fmt(r.get("measured_over_predicted"), 2) if ok else "-",
            _fmt(r["settled_bytes"] / MIB) if ok else "-",
            _fmt(r["predicted"]["between_steps_bytes"] / MIB),
            _fmt(r.get("settled_over_predicted"), 2) if ok else "-",
            _fmt(r.get("tokens_per_s"), 0) if ok else "-",
            _fmt(r.get("tflops_per_s_per_rank"), 4) if ok else "-",
            _fmt(r.get("step_time_median_s"), 2) if ok else "-",
            f"{r['step_time_spread']:.0%}" if ok and r.get("step_time_spread") is not None else "-",
            _fmt(r.get("final_loss"), 3) if ok else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def slopes_table(records: list[dict[str, Any]]) -> str:
    """Per strategy: bytes per parameter the memory grows by across sizes (fixed costs cancel) against the planner."""
    header = (
        "| strategy | micro-batch | precision | predicted at step, bytes/param | peak: bytes/param (slope) "
        "| peak: fixed MiB | predicted between steps, bytes/param | after last step: bytes/param (slope) "
        "| after last step: fixed MiB | largest model: peak/predicted | largest model: after/predicted |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for (label, micro_batch, precision), group in series(records).items():
        peak, settled = memory_slope(group), memory_slope(group, "settled_bytes")
        predicted = group[-1]["predicted"]["device_bytes"] / group[-1]["parameters"]
        between = group[-1]["predicted"]["between_steps_bytes"] / group[-1]["parameters"]
        largest = next((r for r in reversed(group) if r["status"] == "ok"), None)
        cells = [
            label,
            str(micro_batch),
            precision,
            _fmt(predicted, 2),
            _fmt(peak[0] if peak else None, 2),
            _fmt(peak[1] / MIB if peak else None),
            _fmt(between, 2),
            _fmt(settled[0] if settled else None, 2),
            _fmt(settled[1] / MIB if settled else None),
            _fmt(largest["measured_over_predicted"], 2) if largest else "-",
            _fmt(largest["settled_over_predicted"], 2) if largest else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def best_table(records: list[dict[str, Any]], budget: Optional[float]) -> str:
    header = (
        "| model | params (M) | micro-batch | precision | fastest that fits | tokens/s | its memory (MiB) "
        "| leanest | its memory (MiB) | its tokens/s | cells that fit |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for row in best_by_size(records, budget):
        fast, lean = row["fastest"], row["leanest"]
        cells = [
            row["model"],
            _fmt(row["parameters"] / 1e6, 2),
            str(row["micro_batch_size"]),
            row["precision"],
            fast["strategy_label"] if fast else "none",
            _fmt(fast["tokens_per_s"], 0) if fast else "-",
            _fmt(fast["memory_bytes"] / MIB) if fast else "-",
            lean["strategy_label"] if lean else "none",
            _fmt(lean["memory_bytes"] / MIB) if lean else "-",
            _fmt(lean["tokens_per_s"], 0) if lean else "-",
            f"{row['fit']}/{row['cells']}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def failures_list(records: list[dict[str, Any]]) -> str:
    return "\n".join(f"- `{r['cell_id']}`: {r['status']}: {r['error']}" for r in records if r["status"] != "ok")


def losses_section(records: list[dict[str, Any]], tolerance: float) -> str:
    """Per model size: the reference strategy's first and last loss, each strategy's largest per-step gap to it,
    and the verdicts (every curve falls; every gap within ``tolerance``)."""
    rows = agreement(records, tolerance)
    if not rows:
        return "No cell recorded per-step losses."
    intro = (
        f"Per-step losses of the global batch (mean of the ranks). The same seed gives the same initial weights and "
        f"batches under every strategy, so the curves differ only by the order in which gradients are summed. Gap = "
        f"the largest |loss - reference| / reference over the steps; agree = every gap at most {tolerance:g} "
        f"(`loss_tolerance`). Falls = the mean of the last three losses is below that of the first three."
    )
    header = "| model | micro-batch | precision | reference | first loss | last loss | falls | largest gaps | agree |"
    lines = [intro, "", header, "|" + "---|" * (header.count("|") - 1)]
    for row in rows:
        gaps = ", ".join(f"{name} {gap:.1e}" for name, gap in sorted(row["gaps"].items()) if name != row["reference"])
        cells = [
            row["model"],
            str(row["micro_batch_size"]),
            row["precision"],
            row["reference"],
            f"{row['first_loss']:.4f}",
            f"{row['last_loss']:.4f}",
            "yes" if row["all_fall"] else "NO",
            gaps or "-",
            "yes" if row["agree"] else "NO",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    verdict = all(row["agree"] for row in rows) and all(row["all_fall"] for row in rows)
    lines += ["", f"**All sizes fall and agree: {'yes' if verdict else 'no'}.**"]
    return "\n".join(lines)
