"""Prove the autotuner's pick on the two-node testbed: at each link speed, the tuned launch against a measured grid.

    sudo python benchmarks/autotune_testbed.py --out results/autotune          # 50mbit, 200mbit and 2gbit
    sudo python benchmarks/autotune_testbed.py --speeds 200mbit --rounds 1 --quick --out /tmp/atb_smoke

Per speed, on one testbed (two network namespaces joined by a tc-shaped veth, 2 nodes x 2 CPU ranks):
1. one launch with ``HpzStrategy(autotune=True)`` records the decision (the probe's link figures, every candidate with
   its predictions, the pick) and its own step times;
2. every candidate of that decision trains explicitly (its hpZ size and ZeRO-3 thresholds given), ``--rounds`` rounds
   in alternating order; the medians of the measured steps (rounds pooled, warm-up left out) are compared. A round is
   one launch that trains the candidates one after the other (a new Trainer and strategy each, the processes and
   their start-up shared: about 40 s of a launch on 2 cores is start-up); ``--separate-launches`` starts a launch per
   candidate and round instead (slower, nothing shared).
Checks per speed: the probe's inter-node rate within 15% of the tc rate, and the pick's median step time within 5% of
the fastest fitting candidate's. ``results.json`` and ``results.md`` go to ``--out`` (rewritten after every speed), the
runs to ``--out/<speed>/``. Exit code 0 only when every speed ran and passed both. Needs root, ``ip`` and ``tc``;
each testbed is removed at the end, also after an error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

from lightning_hpz.bench import autotune_grid as grid
from lightning_hpz.bench.command import EXIT_UNAVAILABLE, refuse_where_unavailable, signals_end_the_run
from lightning_hpz.bench.launch import (
    ConfigurationFailedError,
    Launch,
    read_records,
    run_configuration,
    run_sequence,
)
from lightning_hpz.bench.testbed import LinkShape, TestbedUnavailableError, TwoNodeTestbed

PROGRAM = "autotune_testbed"
DEFAULT_SPEEDS = ("50mbit", "200mbit", "2gbit")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROGRAM, description=__doc__.splitlines()[0])
    parser.add_argument("--speeds", nargs="+", default=list(DEFAULT_SPEEDS), help="link rates, one testbed each (tc)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the measured grid, in alternating order")
    parser.add_argument(
        "--memory-gib", type=float, help="memory budget per rank given to the tuner (default: measured)"
    )
    parser.add_argument("--quick", action="store_true", help="the smaller benchmark model (QUICK_WORKLOAD)")
    parser.add_argument("--steps", type=int, help="training steps per candidate and round (default 6)")
    parser.add_argument("--warmup", type=int, help="first steps left out of the measurement (default 2)")
    parser.add_argument("--devices-per-node", type=int, default=2, help="processes per node (>= 2)")
    parser.add_argument("--latency", default="0ms", help="added one-way delay (needs tc netem); default none")
    parser.add_argument("--mtu", type=int, default=9000, help="MTU of the link")
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json/.md and the runs")
    parser.add_argument(
        "--separate-launches", action="store_true", help="one launch per candidate and round (default: one per round)"
    )
    parser.add_argument(
        "--from-runs",
        action="store_true",
        help="only summarize the runs already under --out (same arguments as the run); builds no testbed",
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds one launch may take")
    parser.add_argument("--port", type=int, default=29710, help="first rendezvous port (inside the testbeds only)")
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(list(argv))
    args.steps = args.steps or 6  # 4 measured steps a round: the full default run stays near 20 minutes
    args.warmup = 2 if args.warmup is None else args.warmup
    try:
        for bandwidth in args.speeds:
            LinkShape(bandwidth, args.latency, args.mtu)
    except ValueError as err:
        parser.error(str(err))
    if len(set(args.speeds)) != len(args.speeds):
        parser.error(f"--speeds {args.speeds}: a speed is listed twice; give each once.")
    if args.devices_per_node < 2:
        parser.error(f"--devices-per-node {args.devices_per_node}: hpZ needs at least 2 processes per node.")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: run at least one round.")
    if args.warmup < 1 or args.steps < args.warmup + 2:
        parser.error(f"--steps {args.steps} --warmup {args.warmup}: need warmup >= 1 and 2 measured steps after it.")
    if args.memory_gib is not None and args.memory_gib <= 0:
        parser.error(f"--memory-gib {args.memory_gib}: give a positive budget, or leave it out to have it measured.")
    return args


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    command = f"python benchmarks/{PROGRAM}.py " + shlex.join(argv)
    workload = _workload(args.quick)
    if args.from_runs:
        return _report(
            args, command, workload, [load_speed(args, bandwidth, workload) for bandwidth in args.speeds], []
        )
    refuse_where_unavailable(PROGRAM)
    ports = itertools.count(args.port)  # a fresh rendezvous port per launch: the last may still be in TIME_WAIT
    speeds: list[dict[str, Any]] = []
    leftovers: list[str] = []
    try:
        with signals_end_the_run():
            for bandwidth in args.speeds:
                speed, left = run_speed(args, bandwidth, workload, ports)
                speeds.append(speed)
                leftovers += left
                write_results(args, command, workload, speeds, leftovers)
    except TestbedUnavailableError as err:
        print(f"{PROGRAM}: {err}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except KeyboardInterrupt as err:  # Ctrl-C or SIGTERM: the testbed is already removed
        print(
            f"{PROGRAM}: interrupted ({err or 'Ctrl-C'}); finished speeds are in {args.out}/results.json",
            file=sys.stderr,
        )
        return 130
    return _report(args, command, workload, speeds, leftovers)


def _report(
    args: argparse.Namespace, command: str, workload: Any, speeds: list[dict[str, Any]], leftovers: list[str]
) -> int:
    results = write_results(args, command, workload, speeds, leftovers)
    print(grid.markdown(results))
    print(f"results in {args.out}/results.json and results.md")
    return 0 if results["all_pass"] and not leftovers else 1


def load_speed(args: argparse.Namespace, bandwidth: str, workload: Any) -> dict[str, Any]:
    """One speed's summary from the rank records an earlier run left under ``--out/<speed>``."""
    base = args.out / bandwidth
    expected = 2 * args.devices_per_node
    try:
        tuned = read_records(base / "tuned", expected, base / "tuned" / "log.txt")
        decision = grid.recorded_decision(tuned)
    except (ConfigurationFailedError, grid.DecisionMissingError) as err:
        return grid.failed_speed(bandwidth, str(err))
    runs: dict[str, list[list[dict[str, Any]]]] = {}
    failed: dict[str, str] = {}
    for index, candidate in enumerate(decision["candidates"]):
        folder = base / grid.run_folder(index, candidate["name"])
        rounds = sorted(folder.glob("round*"), key=lambda path: int(path.name[5:]))
        runs[candidate["name"]] = [
            read_records(r, expected, r) for r in rounds if len(list(r.glob("rank*.json"))) == expected
        ]
        if not runs[candidate["name"]]:
            failed[candidate["name"]] = f"no complete round under {folder}"
    return grid.summarize_speed(
        bandwidth, tuned, runs, failed, 2 * args.devices_per_node * workload.tokens_per_rank_step
    )


def run_speed(args: argparse.Namespace, bandwidth: str, workload: Any, ports: Iterator[int]) -> tuple[dict, list[str]]:
    """The tuned launch and the measured grid on one testbed; returns the speed's summary and what was left over."""
    started = time.monotonic()
    base = args.out / bandwidth
    tokens_per_step = 2 * args.devices_per_node * workload.tokens_per_rank_step
    with TwoNodeTestbed(LinkShape(bandwidth, args.latency, args.mtu)) as testbed:

        def launch() -> Launch:
            return Launch(testbed, args.devices_per_node, next(ports), args.timeout)

        _say(f"{bandwidth}: tuned launch (autotune=True, memory budget {args.memory_gib or 'measured'})")
        spec = grid.launch_spec(
            grid.tuned_strategy_kwargs(args.memory_gib),
            workload.to_dict(),
            args.steps,
            args.warmup,
            args.devices_per_node,
        )
        try:
            tuned = run_configuration(launch(), spec, base / "tuned")
            decision = grid.recorded_decision(tuned)
        except (ConfigurationFailedError, grid.DecisionMissingError) as err:
            _say(f"{bandwidth}: tuned launch FAILED: {err}")
            return grid.failed_speed(bandwidth, str(err)), testbed.leftovers()
        _say(_decision_line(bandwidth, decision))
        runs, failed = run_grid(args, bandwidth, decision["candidates"], base, workload, launch)
    speed = grid.summarize_speed(bandwidth, tuned, runs, failed, tokens_per_step)
    speed["wall_s"] = time.monotonic() - started
    _say(f"{bandwidth}: done in {speed['wall_s']:.0f} s")
    return speed, testbed.leftovers()


def run_grid(
    args: argparse.Namespace,
    bandwidth: str,
    candidates: list[dict[str, Any]],
    base: Path,
    workload: Any,
    launch: Callable[[], Launch],
) -> tuple[dict[str, list[list[dict[str, Any]]]], dict[str, str]]:
    """Every candidate, explicitly, ``--rounds`` times in alternating order; a failed candidate is not retried."""
    folders = {c["name"]: base / grid.run_folder(i, c["name"]) for i, c in enumerate(candidates)}
    runs: dict[str, list[list[dict[str, Any]]]] = {c["name"]: [] for c in candidates}
    failed: dict[str, str] = {}
    for round_index, order in enumerate(grid.round_orders(candidates, args.rounds)):
        round_name = f"round{round_index + 1}"
        for group in [[c] for c in order] if args.separate_launches else [order]:
            group = [c for c in group if c["name"] not in failed]
            if not group:
                continue
            names = [c["name"] for c in group]
            _say(f"{bandwidth}: {round_name}/{args.rounds} {', '.join(names)}")
            entries = [(grid.candidate_strategy_kwargs(c), str(folders[c["name"]] / round_name)) for c in group]
            spec = grid.sequence_spec(entries, workload.to_dict(), args.steps, args.warmup, args.devices_per_node)
            where = base / ("launches" if not args.separate_launches else folders[names[0]].name) / round_name
            records, error = run_sequence(launch(), spec, where)
            _collect(names, records, error, runs, failed, bandwidth)
    return runs, failed


def _collect(
    names: list[str],
    records: list[Optional[list[dict[str, Any]]]],
    error: Optional[str],
    runs: dict[str, list[list[dict[str, Any]]]],
    failed: dict[str, str],
    bandwidth: str,
) -> None:
    """Keep what a launch finished; the first candidate without records is the one that failed (those after it in
    the same launch did not start, and run again next round)."""
    for name, found in zip(names, records, strict=True):
        if found is not None:
            runs[name].append(found)
            continue
        failed[name] = error or "its ranks wrote no records"
        _say(f"{bandwidth}: {name} FAILED: {failed[name]}")
        return


def write_results(
    args: argparse.Namespace, command: str, workload: Any, speeds: list[dict[str, Any]], leftovers: list[str]
) -> dict[str, Any]:
    from lightning_hpz.bench.workload import parameter_count

    parameters = parameter_count(workload)
    results = {
        "title": f"2 nodes x {args.devices_per_node} CPU processes, {parameters / 1e6:.2f}M params fp32",
        "command": command,
        "workload": workload.to_dict(),
        "parameter_count": parameters,
        "devices_per_node": args.devices_per_node,
        "latency": args.latency,
        "mtu": args.mtu,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "memory_gib": args.memory_gib,
        "speeds": speeds,
        "speeds_not_run": [b for b in args.speeds if b not in {s["bandwidth"] for s in speeds}],
        "all_pass": grid.all_pass(speeds) and len(speeds) == len(args.speeds),
        "testbed_leftovers": leftovers,
        "notes": grid.NOTES,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    (args.out / "results.md").write_text(grid.markdown(results))
    return results


def _workload(quick: bool) -> Any:
    from lightning_hpz.bench.workload import FULL_WORKLOAD, QUICK_WORKLOAD  # torch: not needed for --help

    return QUICK_WORKLOAD if quick else FULL_WORKLOAD


def _decision_line(bandwidth: str, decision: dict[str, Any]) -> str:
    links = decision["links"]
    return (
        f"{bandwidth}: probe inter-node {links['inter_node_gbps']:.3f} Gbit/s, intra-node "
        f"{links['intra_node_gbps']:.3f} Gbit/s; pick {decision['candidate']} of {len(decision['candidates'])}"
    )


def _say(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} autotune] {line}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
