"""Turn every rank's record into per-configuration numbers, comparisons, and the three outputs (JSON, table, chart)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Optional

# Configurations whose arithmetic is identical to plain ZeRO-3 (hpZ changes who sends what, not what is computed).
SAME_ARITHMETIC_AS_ZERO3 = ("zero3", "hpz-event", "hpz-stream", "hpz-none", "deepspeed-hpz")
EXACT_TOLERANCE = 1e-6  # absolute, on the rank-mean loss: float printing noise only
CLOSE_TOLERANCE = 2e-3  # relative: other frameworks reduce gradients in another order


def summarize_run(
    name: str, rounds: list[list[dict[str, Any]]], tokens_per_step: int, link_bytes_per_s: Optional[float] = None
) -> dict[str, Any]:
    """Step times, throughput, cross-node bytes and losses of one configuration.

    ``rounds`` holds every rank's record of each time the configuration ran: step times are pooled over the rounds
    (rank 0's; the ranks step in lockstep), bytes are averaged, and the losses of later rounds must repeat the first.
    With ``link_bytes_per_s`` (one direction's rate) the summary also gives the seconds per step the busier direction
    of the link needs for its bytes: the step time if nothing but the link took time.
    """
    times = [t for records in rounds for t in records[0]["step_times"]]
    q1, median, q3 = statistics.quantiles(times, n=4) if len(times) > 1 else (times[0],) * 3
    world = len(rounds[0])
    bytes_by_round = [_link_bytes(records) / len(records[0]["step_times"]) for records in rounds]
    trajectories = [_mean_trajectory(records) for records in rounds]
    return {
        "name": name,
        "rounds": len(rounds),
        "measured_steps": len(times),
        "step_time_median_s": median,
        "step_time_iqr_s": [q1, q3],
        "step_time_range_s": [min(times), max(times)],
        "steps_per_s": 1.0 / median,
        "tokens_per_s": tokens_per_step / median,
        "cross_node_bytes_per_step": statistics.fmean(bytes_by_round),
        "cross_node_bytes_per_step_by_round": bytes_by_round,
        "cross_node_bytes_per_rank_step": statistics.fmean(bytes_by_round) / world,
        "final_loss": trajectories[0][-1],
        "loss_trajectory": trajectories[0],
        "loss_difference_between_rounds": max(_max_difference(t, trajectories[0]) for t in trajectories),
        "link_bound_step_s": _busier_direction_bytes(rounds) / link_bytes_per_s if link_bytes_per_s else None,
        "peak_rss_bytes_per_rank": _peak_rss(rounds),
    }


def _peak_rss(rounds: list[list[dict[str, Any]]]) -> Optional[float]:
    """Median over the rounds of the ranks' mean peak resident memory (``None`` for records without it)."""
    if not all("peak_rss_bytes" in record for records in rounds for record in records):
        return None  # recorded before the field existed
    return statistics.median(statistics.fmean(r["peak_rss_bytes"] for r in records) for records in rounds)


def _busier_direction_bytes(rounds: list[list[dict[str, Any]]]) -> float:
    """Per step, the bytes of the link direction that carried more, averaged over the rounds."""
    per_round = []
    for records in rounds:
        ends = [r["tx_bytes_end"] - r["tx_bytes_start"] for r in records if r["tx_bytes_start"] is not None]
        per_round.append(max(ends, default=0) / len(records[0]["step_times"]))
    return statistics.fmean(per_round)


def _link_bytes(records: list[dict[str, Any]]) -> int:
    """Both veth ends' transmit counters over the measured window (read by each node's first rank)."""
    return sum(r["tx_bytes_end"] - r["tx_bytes_start"] for r in records if r["tx_bytes_start"] is not None)


def _mean_trajectory(records: list[dict[str, Any]]) -> list[float]:
    return [statistics.fmean(step) for step in zip(*(r["losses"] for r in records), strict=True)]


def _max_difference(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def add_prediction(
    summary: dict[str, Any],
    predicted: Optional[float],
    source: str,
    devices_per_node: Optional[int] = None,
    link_bytes_per_s: Optional[float] = None,
) -> None:
    """The planner's bytes beside the measured ones; with the layout and link rate also the planner's link-bound
    seconds (``lightning-hpz plan``'s cross-node time: a node's bytes over its link, each direction carrying one
    node's), beside the measured ``link_bound_step_s``."""
    summary["predicted_cross_node_bytes_per_rank_step"] = predicted
    summary["prediction_source"] = source
    measured = summary["cross_node_bytes_per_rank_step"]
    summary["measured_over_predicted"] = measured / predicted if predicted else None
    if predicted is not None and devices_per_node and link_bytes_per_s:
        summary["predicted_link_bound_step_s"] = predicted * devices_per_node / link_bytes_per_s


def loss_agreement(summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Largest step-wise loss difference of each configuration to the reference, and whether it is within tolerance.

    Configurations in :data:`SAME_ARITHMETIC_AS_ZERO3` must match the reference exactly; the others (other ZeRO
    stages, FSDP2, DDP) compute the same update with gradients reduced in another order, so they must stay close.
    """
    reference = next((n for n in SAME_ARITHMETIC_AS_ZERO3 if n in summaries), next(iter(summaries)))
    base = summaries[reference]["loss_trajectory"]
    checks = {}
    for name, summary in summaries.items():
        difference = _max_difference(summary["loss_trajectory"], base)
        exact = name in SAME_ARITHMETIC_AS_ZERO3 and reference in SAME_ARITHMETIC_AS_ZERO3
        limit = EXACT_TOLERANCE if exact else CLOSE_TOLERANCE * max(abs(x) for x in base)
        checks[name] = {
            "max_difference": difference,
            "tolerance": limit,
            "expected": "exact" if exact else "close",
            "agrees": difference <= limit,
        }
    return {"reference": reference, "configurations": checks, "all_agree": all(c["agrees"] for c in checks.values())}


def headline(summaries: dict[str, dict[str, Any]], hpz_name: str = "hpz-event") -> dict[str, Optional[float]]:
    """The comparisons the benchmark exists for (``None`` where a configuration was not run)."""

    def ratio(numerator: str, denominator: str, key: str) -> Optional[float]:
        if numerator in summaries and denominator in summaries:
            return summaries[numerator][key] / summaries[denominator][key]
        return None

    deviations = [abs(s["measured_over_predicted"] - 1) for s in summaries.values() if s.get("measured_over_predicted")]
    return {
        "largest_bytes_deviation_from_model": max(deviations) if deviations else None,
        "hpz_over_zero3_cross_node_bytes": ratio(hpz_name, "zero3", "cross_node_bytes_per_step"),
        "hpz_over_zero3_steps_per_s": ratio(hpz_name, "zero3", "steps_per_s"),
        "strategy_over_raw_engine_step_time": ratio(hpz_name, "deepspeed-hpz", "step_time_median_s"),
        "hpz_over_fsdp2_node_step_time": ratio(hpz_name, "fsdp2-node", "step_time_median_s"),
    }


def markdown_table(results: dict[str, Any]) -> str:
    lines = [
        f"Command: `{results['command']}`",
        "",
        f"{results['title']}; {results['rounds']} round(s) x {results['steps'] - results['warmup']} measured steps "
        f"per configuration (after {results['warmup']} warm-up steps).",
        "",
        "| configuration | step s (median) | IQR s | link-bound s | predicted link-bound s | tokens/s | "
        "cross-node MB/step | per rank MB | predicted MB | meas/pred | final loss | loss agrees |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    agreement = results["loss_agreement"]["configurations"]
    for name, summary in results["configurations"].items():
        lines.append("| " + " | ".join(_table_cells(name, summary, agreement[name])) + " |")
    lines += ["", *(f"- {key}: {_fmt(value)}" for key, value in results["headline"].items())]
    lines += ["", *(f"- {note}" for note in results["notes"])]
    return "\n".join(lines) + "\n"


def timing_cells(s: dict[str, Any]) -> list[str]:
    """Median step time, its IQR, and the measured and predicted link-bound seconds of one configuration."""
    q1, q3 = s["step_time_iqr_s"]
    return [
        f"{s['step_time_median_s']:.3f}",
        f"{q1:.3f}-{q3:.3f}",
        number(s.get("link_bound_step_s"), "{:.3f}"),
        number(s.get("predicted_link_bound_step_s"), "{:.3f}"),
    ]


def _table_cells(name: str, s: dict[str, Any], agreement: dict[str, Any]) -> list[str]:
    return [
        name,
        *timing_cells(s),
        f"{s['tokens_per_s']:.0f}",
        f"{s['cross_node_bytes_per_step'] / 1e6:.2f}",
        f"{s['cross_node_bytes_per_rank_step'] / 1e6:.3f}",
        number(s.get("predicted_cross_node_bytes_per_rank_step"), "{:.3f}", scale=1e-6),
        number(s.get("measured_over_predicted"), "{:.3f}"),
        f"{s['final_loss']:.4f}",
        f"{'yes' if agreement['agrees'] else 'NO'} ({agreement['expected']}, {agreement['max_difference']:.1e})",
    ]


def number(value: Optional[float], form: str, scale: float = 1.0) -> str:
    """``value`` formatted (times ``scale``), or '-' where there is none."""
    return "-" if value is None else form.format(value * scale)


def _fmt(value: Optional[float]) -> str:
    return "not run" if value is None else f"{value:.3f}"


def write_outputs(results: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(markdown_table(results))
    write_chart(results, out / "results.png")


def write_chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = results["configurations"]
    names = list(summaries)
    figure, (time_axis, bytes_axis) = plt.subplots(1, 2, figsize=(12, 4.5))
    medians = [summaries[n]["step_time_median_s"] for n in names]
    errors = [
        [m - summaries[n]["step_time_iqr_s"][0] for n, m in zip(names, medians, strict=True)],
        [summaries[n]["step_time_iqr_s"][1] - m for n, m in zip(names, medians, strict=True)],
    ]
    time_axis.bar(names, medians, yerr=errors, capsize=3, color="tab:blue")
    bound = [summaries[n].get("link_bound_step_s") for n in names]
    if all(b is not None for b in bound):
        time_axis.scatter(names, bound, marker="_", s=400, color="tab:red", zorder=3, label="link-bound time")
        time_axis.legend()
    time_axis.set_ylabel("step time, s (median, IQR)")
    positions = range(len(names))
    measured = [summaries[n]["cross_node_bytes_per_rank_step"] / 1e6 for n in names]
    predicted = [(summaries[n].get("predicted_cross_node_bytes_per_rank_step") or 0) / 1e6 for n in names]
    bytes_axis.bar([p - 0.2 for p in positions], measured, width=0.4, label="measured (veth)")
    bytes_axis.bar([p + 0.2 for p in positions], predicted, width=0.4, label="model")
    bytes_axis.set_xticks(list(positions), names)
    bytes_axis.set_ylabel("cross-node MB per rank per step")
    bytes_axis.legend()
    for axis in (time_axis, bytes_axis):
        axis.tick_params(axis="x", rotation=45)
    figure.suptitle(results["title"])
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
