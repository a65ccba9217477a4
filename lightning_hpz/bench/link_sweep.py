"""Several link speeds in one command: ``lightning-hpz bench --bandwidth 50mbit 200mbit 1gbit 2gbit ...``.

Each speed is a whole benchmark of its own (a fresh testbed, every configuration once per round, the rounds alternating
the order) written to ``--out/<rate>/``. Once all speeds ran, the comparison goes to ``--out/comparison.md`` (one
table per speed, with the planner's prediction and the memory per rank beside each measurement, then the step times
of all speeds side by side) and ``--out/step_time_vs_link.png`` (step time against link rate, log-log, one line per
configuration, the planner's link-bound time dotted beside it).
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from lightning_hpz.bench.results import number, timing_cells

BYTES_TOLERANCE = 0.05  # measured cross-node bytes must lie within 5% of the planner's (issue 29)
MIB = 2**20


def speed_folder(out: Path, bandwidth: str) -> Path:
    return out / bandwidth


def run_sweep(
    args: argparse.Namespace, command: str, run_one: Callable[[argparse.Namespace, str], dict[str, Any]]
) -> list[dict[str, Any]]:
    """``run_one(arguments of one speed, command)`` for every speed in turn; then the comparison is written."""
    per_speed = []
    for shape in args.shapes:
        speed_args = copy.copy(args)
        speed_args.shape, speed_args.out = shape, speed_folder(args.out, shape.bandwidth)
        per_speed.append(run_one(speed_args, command))
        args.port = speed_args.port  # rendezvous ports keep counting up across the speeds
    write_comparison(per_speed, args.out)
    return per_speed


def write_comparison(per_speed: list[dict[str, Any]], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "comparison.json").write_text(json.dumps(verdicts(per_speed), indent=1))
    (out / "comparison.md").write_text(comparison_markdown(per_speed))
    write_chart(per_speed, out / "step_time_vs_link.png")


def verdicts(per_speed: list[dict[str, Any]]) -> dict[str, Any]:
    """Per speed: did every configuration train, agree with the reference loss, and match the planner's bytes?"""
    speeds = {}
    for results in per_speed:
        agreement = results["loss_agreement"].get("configurations", {})
        bytes_ok = {
            name: _within(s.get("measured_over_predicted"), BYTES_TOLERANCE)
            for name, s in results["configurations"].items()
        }
        speeds[results["link"]["bandwidth"]] = {
            "failed": results["failed"],
            "losses_agree": {name: check["agrees"] for name, check in agreement.items()},
            "bytes_within_5_percent": bytes_ok,
        }
    every = [
        not v["failed"] and all(v["losses_agree"].values()) and all(v["bytes_within_5_percent"].values())
        for v in speeds.values()
    ]
    return {"speeds": speeds, "all_pass": all(every)}


def _within(ratio: Optional[float], tolerance: float) -> bool:
    return ratio is not None and abs(ratio - 1) <= tolerance


def comparison_markdown(per_speed: list[dict[str, Any]]) -> str:
    """The comparison, headed by the command that ran the rates (a ``--from-runs`` summary keeps the original)."""
    first = per_speed[0]
    lines = [
        f"Command: `{first['command']}`",
        "",
        f"2 nodes x {first['devices_per_node']} CPU processes, {first['parameter_count'] / 1e6:.2f}M parameters "
        f"fp32; {first['rounds']} round(s) x {first['steps'] - first['warmup']} measured steps per configuration and "
        f"speed (after {first['warmup']} warm-up steps); medians pooled over the rounds.",
        "",
    ]
    for results in per_speed:
        lines += _speed_table(results)
    lines += _step_time_overview(per_speed)
    outcome = verdicts(per_speed)
    answer = "yes" if outcome["all_pass"] else "no"
    lines += [
        "",
        "Every configuration trained, agreed with the reference loss and measured within 5% of the planner's "
        f"cross-node bytes at every speed: **{answer}**.",
    ]
    return "\n".join(lines) + "\n"


def _speed_table(results: dict[str, Any]) -> list[str]:
    agreement = results["loss_agreement"]
    lines = [
        f"### {results['link']['bandwidth']}",
        "",
        "| configuration | step s (median) | IQR s | link-bound s | predicted link-bound s | cross-node MB per rank "
        "and step | predicted MB | meas/pred | loss gap to " + agreement.get("reference", "-") + " (tolerance) | "
        "model states MiB per rank (planner) | peak RSS MiB per rank (measured) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in results["configurations"].items():
        check = agreement["configurations"][name]
        cells = [
            name,
            *timing_cells(s),
            f"{s['cross_node_bytes_per_rank_step'] / 1e6:.3f}",
            number(s.get("predicted_cross_node_bytes_per_rank_step"), "{:.3f}", 1e-6),
            number(s.get("measured_over_predicted"), "{:.3f}"),
            f"{check['max_difference']:.1e} ({check['tolerance']:.1e}, {'ok' if check['agrees'] else 'NO'})",
            number(s.get("predicted_model_state_bytes_per_rank"), "{:.1f}", 1 / MIB),
            number(s.get("peak_rss_bytes_per_rank"), "{:.0f}", 1 / MIB),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [f"| {name} | failed: {reason} |" + " |" * 9 for name, reason in results["failed"].items()]
    return [*lines, ""]


def _step_time_overview(per_speed: list[dict[str, Any]]) -> list[str]:
    bandwidths = [r["link"]["bandwidth"] for r in per_speed]
    names = list(dict.fromkeys(n for r in per_speed for n in r["configurations"]))
    lines = [
        "### Median step time, s, at every speed",
        "",
        "| configuration | " + " | ".join(bandwidths) + " |",
        "|---|" + "---|" * len(bandwidths),
    ]
    for name in names:
        cells = [number(r["configurations"].get(name, {}).get("step_time_median_s"), "{:.3f}") for r in per_speed]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def write_chart(per_speed: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lightning_hpz.bench.testbed import parse_rate

    rates = [parse_rate(r["link"]["bandwidth"]) / 1e9 for r in per_speed]
    names = list(dict.fromkeys(n for r in per_speed for n in r["configurations"]))
    figure, axis = plt.subplots(figsize=(7.5, 5))
    for index, name in enumerate(names):
        color = f"C{index}"
        points = [(rate, r["configurations"].get(name)) for rate, r in zip(rates, per_speed, strict=True)]
        measured = [(rate, s) for rate, s in points if s]
        axis.errorbar(
            [rate for rate, _ in measured],
            [s["step_time_median_s"] for _, s in measured],
            yerr=_iqr_errors([s for _, s in measured]),
            marker="os^vDP*"[index % 7],
            color=color,
            capsize=3,
            label=name,
        )
        predicted = [(rate, s.get("predicted_link_bound_step_s")) for rate, s in measured]
        axis.plot([r for r, p in predicted if p], [p for _, p in predicted if p], ":", color=color)
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xticks(rates, [r["link"]["bandwidth"] for r in per_speed])
    axis.minorticks_off()
    axis.set_xlabel("link between the nodes (each way)")
    axis.set_ylabel("step time, s (median, IQR); dotted: planner's link-bound time")
    axis.set_title("Step time against link speed, 2 nodes x 2 CPU ranks")
    axis.legend()
    axis.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _iqr_errors(summaries: list[dict[str, Any]]) -> list[list[float]]:
    medians = [s["step_time_median_s"] for s in summaries]
    return [
        [m - s["step_time_iqr_s"][0] for m, s in zip(medians, summaries, strict=True)],
        [s["step_time_iqr_s"][1] - m for m, s in zip(medians, summaries, strict=True)],
    ]
