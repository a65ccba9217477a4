"""Does the autotuner pick well? One tuned launch per link speed against a measured grid of its own candidates.

The tuned launch (``HpzStrategy(autotune=True)``) records the decision: the probe's link figures, every candidate with
its predictions, and the pick. Each candidate is then trained explicitly (its hpZ size and ZeRO-3 thresholds given,
nothing tuned) for several rounds. Here: the specs of those launches, and the comparisons made of their rank records
(step-time medians, the pick against the fastest candidate, the probe against the ``tc`` rate), as JSON and Markdown.
Nothing here builds a testbed or starts a process (``benchmarks/autotune_testbed.py`` does).
"""

from __future__ import annotations

import re
import statistics
from typing import Any, Optional

from lightning_hpz.bench import results as res
from lightning_hpz.bench.testbed import parse_rate

PROBE_TOLERANCE = 0.15  # the probe's inter-node rate may differ from the tc rate by this fraction
PICK_TOLERANCE = 1.05  # the pick's median step time may exceed the fastest candidate's by this factor
# Any configuration driven by a Trainer: the spec's strategy_kwargs replace its HpzStrategy arguments.
LIGHTNING_CONFIGURATION = "hpz-event"
THRESHOLD_KEYS = (
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
)
NOTES = [
    "The tuned launch ran HpzStrategy(stage=3, autotune=True, autotune_memory_gib=--memory-gib); each candidate ran "
    "HpzStrategy(stage=3, hpz_partition_size=<its size>, config={'zero_optimization': <its 4 thresholds>}): the "
    "explicit values the tuner would apply, nothing tuned. Same model, data and seed in every launch.",
    "Step times are rank 0's (the ranks step in lockstep); a candidate's median pools every measured step of every "
    "round (warm-up steps left out); rounds run the candidates in alternating order.",
    "fastest: the lowest median among the candidates the tuner predicted to fit the memory budget (the only ones it "
    "may pick); pick/fastest must be <= 1.05.",
    "probe/tc: the probe's inter-node all-gather rate over the tc tbf rate, which counts IP packets with their "
    "headers (about 1% of a 9000-byte frame); must lie within 15% of 1.",
    "loss diff to tuned: the largest step-wise difference of a candidate's rank-mean loss to the tuned launch's "
    "(ZeRO-3 thresholds and hpZ change when parameters move, not the arithmetic).",
    "Timings come from CPU processes on a shared machine: compare the candidates of one speed with each other only.",
]


class DecisionMissingError(RuntimeError):
    """The tuned launch recorded no autotune decision (or the ranks recorded different ones)."""


# ------------------------------------------------------------------------------------------------------ launch specs
def tuned_strategy_kwargs(memory_gib: Optional[float]) -> dict[str, Any]:
    return {"stage": 3, "autotune": True, "autotune_memory_gib": memory_gib}


def candidate_strategy_kwargs(candidate: dict[str, Any]) -> dict[str, Any]:
    """The explicit HpzStrategy arguments that reproduce one candidate of a decision (nothing left to the tuner)."""
    return {
        "stage": 3,
        "hpz_partition_size": int(candidate["hpz_partition_size"]),
        "config": {"zero_optimization": {key: int(candidate["zero_thresholds"][key]) for key in THRESHOLD_KEYS}},
    }


def launch_spec(
    strategy_kwargs: dict[str, Any], workload: dict[str, Any], steps: int, warmup: int, devices: int
) -> dict[str, Any]:
    """A benchmark rank's spec (see :mod:`lightning_hpz.bench.worker`) with the strategy arguments given in full."""
    return {
        "configuration": LIGHTNING_CONFIGURATION,
        "strategy_kwargs": strategy_kwargs,
        "workload": workload,
        "steps": steps,
        "warmup": warmup,
        "devices_per_node": devices,
    }


def sequence_spec(
    entries: list[tuple[dict[str, Any], str]], workload: dict[str, Any], steps: int, warmup: int, devices: int
) -> dict[str, Any]:
    """A spec that trains each ``(strategy_kwargs, out folder)`` entry in turn within one launch."""
    spec = launch_spec({}, workload, steps, warmup, devices)
    del spec["strategy_kwargs"]
    spec["runs"] = [{"strategy_kwargs": kwargs, "out": out} for kwargs, out in entries]
    return spec


def run_folder(index: int, name: str) -> str:
    """A folder name for a candidate's runs: its position (names may repeat after cleaning) and its name, path-safe."""
    return f"{index:02d}-{re.sub(r'[^A-Za-z0-9._-]+', '_', name)}"


def round_orders(candidates: list[Any], rounds: int) -> list[list[Any]]:
    # Alternate the order so that a slow phase of a shared machine does not always hit the same candidates.
    return [list(candidates) if r % 2 == 0 else list(reversed(candidates)) for r in range(rounds)]


# ------------------------------------------------------------------------------------------------------ the decision
def recorded_decision(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The decision every rank of the tuned launch recorded; refuses a launch where one is missing or they differ."""
    decisions = [record.get("autotune_decision") for record in records]
    if any(decision is None for decision in decisions):
        missing = [record["rank"] for record, decision in zip(records, decisions, strict=True) if decision is None]
        raise DecisionMissingError(
            f"rank(s) {missing} recorded no autotune_decision: does this HpzStrategy support autotune=True?"
        )
    if any(decision != decisions[0] for decision in decisions):
        raise DecisionMissingError("the ranks recorded different autotune decisions; every rank must apply the same.")
    return decisions[0]


def applied_matches_pick(record: dict[str, Any], pick: dict[str, Any]) -> Optional[bool]:
    """Whether the engine config the tuned launch ran with holds the pick's hpZ size and thresholds."""
    zero = record.get("deepspeed_config", {}).get("zero_optimization")
    if zero is None:
        return None
    if int(zero.get("zero_hpz_partition_size", 1)) != int(pick["hpz_partition_size"]):
        return False
    return all(int(zero.get(key, -1)) == int(pick["zero_thresholds"][key]) for key in THRESHOLD_KEYS)


# ----------------------------------------------------------------------------------------------------- comparisons
def verdict(passed: Optional[bool]) -> str:
    return "n/a" if passed is None else ("PASS" if passed else "FAIL")


def probe_over_tc(inter_node_gbps: float, bandwidth: str) -> float:
    return inter_node_gbps * 1e9 / parse_rate(bandwidth)


def probe_passes(ratio: Optional[float]) -> Optional[bool]:
    return None if ratio is None else abs(ratio - 1.0) <= PROBE_TOLERANCE


def pick_passes(ratio: Optional[float]) -> Optional[bool]:
    return None if ratio is None else ratio <= PICK_TOLERANCE


def fastest_candidate(rows: list[dict[str, Any]]) -> Optional[str]:
    """The measured candidate with the lowest median step time among those that fit the memory budget.

    The tuner may only choose a fitting candidate, so the fastest of those is what it is measured against; with none
    measured that fits, the fastest measured one.
    """
    measured = [row for row in rows if row["measured_median_s"] is not None]
    pool = [row for row in measured if row["fits"]] or measured
    return min(pool, key=lambda row: row["measured_median_s"])["name"] if pool else None


def summarize_speed(
    bandwidth: str,
    tuned_records: list[dict[str, Any]],
    grid_runs: dict[str, list[list[dict[str, Any]]]],
    failed: dict[str, str],
    tokens_per_step: int,
) -> dict[str, Any]:
    """Everything reported for one link speed, from the tuned launch's records and each candidate's rounds."""
    decision = recorded_decision(tuned_records)
    tuned = res.summarize_run("tuned", [tuned_records], tokens_per_step)
    rows = [_candidate_row(c, grid_runs.get(c["name"]), tokens_per_step, tuned) for c in decision["candidates"]]
    fastest = fastest_candidate(rows)
    medians = {row["name"]: row["measured_median_s"] for row in rows}
    best = medians.get(fastest) if fastest else None
    for row in rows:
        row["over_fastest"] = row["measured_median_s"] / best if best and row["measured_median_s"] else None
    pick = decision["candidate"]
    pick_candidate = next(c for c in decision["candidates"] if c["name"] == pick)
    pick_ratio = medians[pick] / best if best and medians.get(pick) else None
    probe_ratio = probe_over_tc(decision["links"]["inter_node_gbps"], bandwidth)
    return {
        "bandwidth": bandwidth,
        "tc_gbps": parse_rate(bandwidth) / 1e9,
        "probe": decision["links"],
        "probe_over_tc": probe_ratio,
        "probe_check": verdict(probe_passes(probe_ratio)),
        "pick": pick,
        "reason": decision.get("reason", ""),
        "memory_budget_gib": decision.get("memory_budget_gib"),
        "fastest": fastest,
        "pick_over_fastest": pick_ratio,
        "pick_check": verdict(pick_passes(pick_ratio)),
        "pick_over_fastest_by_round": ratios_by_round(grid_runs.get(pick), grid_runs.get(fastest) if fastest else None),
        "tuned_median_s": tuned["step_time_median_s"],
        "tuned_over_fastest": tuned["step_time_median_s"] / best if best else None,
        "tuned_cross_node_bytes_per_step": tuned["cross_node_bytes_per_step"],
        "applied_matches_pick": applied_matches_pick(tuned_records[0], pick_candidate),
        "decision": decision,
        "candidates": rows,
        "failed": dict(failed),
    }


def ratios_by_round(
    numerator: Optional[list[list[dict[str, Any]]]], denominator: Optional[list[list[dict[str, Any]]]]
) -> list[float]:
    """Round by round, one median step time over another (how much of a ratio is noise); empty unless both ran every
    round."""
    if not numerator or not denominator or len(numerator) != len(denominator):
        return []
    return [_round_median(a) / _round_median(b) for a, b in zip(numerator, denominator, strict=True)]


def _round_median(records: list[dict[str, Any]]) -> float:
    return statistics.median(records[0]["step_times"])


def _candidate_row(
    candidate: dict[str, Any], rounds: Optional[list[list[dict[str, Any]]]], tokens_per_step: int, tuned: dict
) -> dict[str, Any]:
    row = {
        "name": candidate["name"],
        "hpz_partition_size": candidate["hpz_partition_size"],
        "zero_thresholds": candidate["zero_thresholds"],
        "predicted_comm_s": candidate["predicted_comm_s"],
        "predicted_memory_gib": candidate["predicted_memory_gib"],
        "fits": bool(candidate["fits"]),
        "rounds": 0,
        "measured_steps": 0,
        "measured_median_s": None,
        "step_time_iqr_s": None,
        "cross_node_bytes_per_step": None,
        "loss_difference_to_tuned": None,
    }
    if rounds:
        summary = res.summarize_run(candidate["name"], rounds, tokens_per_step)
        row.update(
            rounds=summary["rounds"],
            measured_steps=summary["measured_steps"],
            measured_median_s=summary["step_time_median_s"],
            step_time_iqr_s=summary["step_time_iqr_s"],
            cross_node_bytes_per_step=summary["cross_node_bytes_per_step"],
            loss_difference_to_tuned=_max_difference(summary["loss_trajectory"], tuned["loss_trajectory"]),
        )
    return row


def _max_difference(a: list[float], b: list[float]) -> Optional[float]:
    return max(abs(x - y) for x, y in zip(a, b, strict=True)) if len(a) == len(b) else None


def failed_speed(bandwidth: str, message: str) -> dict[str, Any]:
    """A speed whose tuned launch failed: there is no decision, so no grid either."""
    return {"bandwidth": bandwidth, "tc_gbps": parse_rate(bandwidth) / 1e9, "failed": {"tuned": message}}


def all_pass(speeds: list[dict[str, Any]]) -> bool:
    """Every speed ran completely and passed both checks."""
    return bool(speeds) and all(
        not s["failed"] and s.get("probe_check") == "PASS" and s.get("pick_check") == "PASS" for s in speeds
    )


# ------------------------------------------------------------------------------------------------------- rendering
def markdown(results: dict[str, Any]) -> str:
    """The summary table over the speeds, then one candidate table per speed, then the notes."""
    lines = [
        f"Command: `{results['command']}`",
        "",
        f"{results['title']}; {results['rounds']} round(s) x {results['steps'] - results['warmup']} measured steps "
        f"per candidate (after {results['warmup']} warm-up steps); the tuned launch: one round.",
        "",
        "| link (tc) | probe inter-node Gbit/s | probe/tc | probe within 15% | pick | fastest measured | "
        "pick/fastest | pick within 5% | tuned launch median s | tuned/fastest | config applied |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *(_speed_line(speed) for speed in results["speeds"]),
        "",
        f"Overall: {'PASS' if results['all_pass'] else 'FAIL'}",
    ]
    for speed in results["speeds"]:
        lines += ["", *_speed_section(speed)]
    lines += ["", *(f"- {note}" for note in results["notes"])]
    return "\n".join(lines) + "\n"


def _speed_line(s: dict[str, Any]) -> str:
    if "pick" not in s:
        return f"| {s['bandwidth']} | tuned launch failed: {s['failed'].get('tuned', '?')} |" + " |" * 9
    cells = [
        f"{s['bandwidth']} ({s['tc_gbps']:.3f} Gbit/s)",
        f"{s['probe']['inter_node_gbps']:.3f}",
        f"{s['probe_over_tc']:.3f}",
        s["probe_check"],
        s["pick"],
        s["fastest"] or "-",
        _number(s["pick_over_fastest"]),
        s["pick_check"],
        _number(s["tuned_median_s"]),
        _number(s["tuned_over_fastest"]),
        {True: "yes", False: "NO", None: "-"}[s["applied_matches_pick"]],
    ]
    return "| " + " | ".join(cells) + " |"


def _speed_section(s: dict[str, Any]) -> list[str]:
    lines = [f"### {s['bandwidth']}"]
    if "pick" not in s:
        return [*lines, "", f"Tuned launch failed: {s['failed'].get('tuned', '?')}"]
    probe = s["probe"]
    lines += [
        "",
        f"Probe ({probe['probe_seconds']:.2f} s): inter-node {probe['inter_node_gbps']:.3f} Gbit/s, "
        f"{probe['inter_node_latency_us']:.0f} us; intra-node {probe['intra_node_gbps']:.3f} Gbit/s, "
        f"{probe['intra_node_latency_us']:.0f} us. Memory budget {_number(s['memory_budget_gib'], '{:.2f}')} GiB.",
        f"Pick: {s['pick']} ({s['reason']})",
        f"pick/fastest by round: {', '.join(f'{r:.3f}' for r in s['pick_over_fastest_by_round']) or '-'}",
        "",
        "| candidate | hpZ | thresholds (live, reuse, prefetch, persist) | predicted comm s | predicted GiB | fits | "
        "measured median s | IQR s | /fastest | cross-node MB/step | loss diff to tuned |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *(_candidate_line(row, s["pick"], s["fastest"]) for row in s["candidates"]),
    ]
    lines += [f"- {name} FAILED: {message}" for name, message in s["failed"].items()]
    return lines


def _candidate_line(row: dict[str, Any], pick: str, fastest: Optional[str]) -> str:
    marks = [mark for mark, name in (("pick", pick), ("fastest", fastest)) if name == row["name"]]
    iqr = row["step_time_iqr_s"]
    cells = [
        row["name"] + (f" ({', '.join(marks)})" if marks else ""),
        str(row["hpz_partition_size"]),
        ", ".join(_count(row["zero_thresholds"][key]) for key in THRESHOLD_KEYS),
        _number(row["predicted_comm_s"]),
        _number(row["predicted_memory_gib"], "{:.3f}"),
        "yes" if row["fits"] else "no",
        _number(row["measured_median_s"]),
        f"{iqr[0]:.3f}-{iqr[1]:.3f}" if iqr else "-",
        _number(row["over_fastest"]),
        _number(row["cross_node_bytes_per_step"], "{:.2f}", scale=1e-6),
        _number(row["loss_difference_to_tuned"], "{:.1e}"),
    ]
    return "| " + " | ".join(cells) + " |"


def _count(value: int) -> str:
    """Element counts as people write them where that is exact (0, 50000, 5e7, 1e9), else in full (1850368)."""
    short = f"{value:g}".replace("e+0", "e").replace("e+", "e")
    return short if float(short) == value else str(value)


def _number(value: Optional[float], form: str = "{:.3f}", scale: float = 1.0) -> str:
    return "-" if value is None else form.format(value * scale)
