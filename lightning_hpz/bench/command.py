"""``lightning-hpz bench``: train one model under several configurations on a two-node, rate-limited testbed.

Every configuration runs in the same testbed, one after the other, with the same model, data and seed; the results
(``results.json``, ``results.md``, ``results.png``) go to ``--out``. The testbed is removed at the end, also after a
failure, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_hpz.bench import configurations as configs
from lightning_hpz.bench import link_sweep
from lightning_hpz.bench import results as res
from lightning_hpz.bench.launch import ConfigurationFailedError, Launch, run_configuration
from lightning_hpz.bench.prediction import predicted_cross_node_bytes, predicted_model_state_bytes
from lightning_hpz.bench.testbed import (
    LinkShape,
    TestbedUnavailableError,
    TwoNodeTestbed,
    sweep_abandoned,
    unavailable_reason,
)

if TYPE_CHECKING:
    from lightning_hpz.bench.workload import Workload

EXIT_UNAVAILABLE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-hpz bench", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--bandwidth",
        nargs="+",
        default=["200mbit"],
        help="rate of the link between the nodes, each way (tc); several rates run one benchmark each into "
        "--out/<rate>/ and compare them in --out/comparison.md and step_time_vs_link.png",
    )
    parser.add_argument("--latency", default="0ms", help="added one-way delay (needs tc netem); default none")
    parser.add_argument("--mtu", type=int, default=9000, help="MTU of the link (9000: jumbo frames, as in clusters)")
    parser.add_argument("--devices-per-node", type=int, default=2, help="processes per node (>= 2)")
    parser.add_argument("--steps", type=int, help="training steps per configuration (default 20, --quick 6)")
    parser.add_argument("--warmup", type=int, help="first steps left out of the measurement (default 3, --quick 2)")
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json/.md/.png and the run logs")
    parser.add_argument("--quick", action="store_true", help="a smaller model, fewer steps, fewer configurations")
    parser.add_argument(
        "--configs",
        nargs="+",
        metavar="NAME",
        help=f"configurations to run, in order; any of {list(configs.CONFIGURATIONS)}",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="run the whole list this often, alternating its order; times are pooled"
    )
    parser.add_argument(
        "--from-runs",
        action="store_true",
        help="only summarize the runs already under --out (same arguments as the run); builds no testbed",
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds one configuration may take")
    parser.add_argument("--port", type=int, default=29610, help="first rendezvous port (inside the testbed only)")
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(list(argv))
    args.steps = args.steps or (6 if args.quick else 20)
    if args.warmup is None:
        args.warmup = 2 if args.quick else 3
    try:
        args.shapes = [LinkShape(rate, args.latency, args.mtu) for rate in args.bandwidth]
        args.shape = args.shapes[0]
        args.selected = configs.select(args.configs, args.quick)
    except ValueError as err:
        parser.error(str(err))
    if args.devices_per_node < 2:
        parser.error(f"--devices-per-node {args.devices_per_node}: hpZ needs at least 2 processes per node.")
    if len(set(args.bandwidth)) != len(args.bandwidth):
        parser.error(f"--bandwidth {' '.join(args.bandwidth)}: a rate is listed twice; give each once.")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: run at least one round.")
    if args.steps < args.warmup + 2:
        parser.error(f"--steps {args.steps} leaves fewer than 2 measured steps after --warmup {args.warmup}.")
    return args


def bench_main(argv: Sequence[str] = ()) -> None:
    args = parse_args(argv)
    command = "lightning-hpz bench " + shlex.join(argv)
    if not args.from_runs:
        refuse_where_unavailable()
    run_one = summarize_existing_runs if args.from_runs else run_benchmark
    try:
        sweep = len(args.shapes) > 1
        per_speed = link_sweep.run_sweep(args, command, run_one) if sweep else [run_one(args, command)]
    except TestbedUnavailableError as err:
        print(f"lightning-hpz bench: {err}", file=sys.stderr)
        raise SystemExit(EXIT_UNAVAILABLE) from err
    for results in per_speed:
        print(res.markdown_table(results))
    if len(per_speed) > 1:
        print(f"comparison in {args.out}/comparison.md and step_time_vs_link.png; each speed in {args.out}/<rate>/")
    else:
        print(f"results in {args.out}/results.json, results.md, results.png")
    if any(results["failed"] for results in per_speed):
        raise SystemExit(1)


def refuse_where_unavailable(program: str = "lightning-hpz bench") -> None:
    """Stop before creating anything where the testbed cannot be built; clear away testbeds of killed runs."""
    reason = unavailable_reason()
    if reason:
        print(f"{program}: cannot build the two-node testbed: {reason}.", file=sys.stderr)
        raise SystemExit(EXIT_UNAVAILABLE)
    for name in sweep_abandoned():
        print(f"{program}: removed {name}, left by a benchmark that was killed", file=sys.stderr)


def summarize_existing_runs(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """Recompute the results from the rank records under ``--out/runs``; keeps the command that produced them."""
    earlier = args.out / "results.json"
    if earlier.exists():
        command = json.loads(earlier.read_text())["command"]
    workload = _workload(args.quick)
    return build_results(args, command, workload, load_runs(args.out, args.selected), {}, leftovers=[])


def run_benchmark(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """Train every selected configuration on a fresh testbed, then summarize and write the results."""
    workload = _workload(args.quick)
    runs: dict[str, list[list[dict[str, Any]]]] = {c.name: [] for c in args.selected}
    failed: dict[str, str] = {}
    with signals_end_the_run(), TwoNodeTestbed(args.shape) as testbed:
        for round_index, order in enumerate(_round_orders(args.selected, args.rounds)):
            for configuration in order:
                if configuration.name in failed:
                    continue
                print(
                    f"[bench] round {round_index + 1}/{args.rounds} {configuration.name}: {configuration.description}"
                )
                sys.stdout.flush()
                launch = Launch(testbed, args.devices_per_node, _next_port(args), args.timeout)
                run_dir = args.out / "runs" / configuration.name / f"round{round_index + 1}"
                try:
                    runs[configuration.name].append(
                        run_configuration(launch, _spec(configuration.name, workload, args), run_dir)
                    )
                except ConfigurationFailedError as err:
                    failed[configuration.name] = str(err)
                    print(f"[bench] {configuration.name} FAILED: {err}", flush=True)
    return build_results(args, command, workload, runs, failed, leftovers=testbed.leftovers())


def _workload(quick: bool) -> Workload:
    from lightning_hpz.bench.workload import FULL_WORKLOAD, QUICK_WORKLOAD  # torch: not needed for --help

    return QUICK_WORKLOAD if quick else FULL_WORKLOAD


def load_runs(out: Path, selected: list[configs.BenchConfiguration]) -> dict[str, list[list[dict[str, Any]]]]:
    """Every rank record under ``out/runs`` of an earlier run, per configuration and round."""
    runs: dict[str, list[list[dict[str, Any]]]] = {}
    for configuration in selected:
        rounds = sorted((out / "runs" / configuration.name).glob("round*"), key=lambda p: int(p.name[5:]))
        records = [[json.loads(p.read_text()) for p in r.glob("rank*.json")] for r in rounds]
        runs[configuration.name] = [sorted(rs, key=lambda record: record["rank"]) for rs in records if rs]
    return runs


def build_results(
    args: argparse.Namespace,
    command: str,
    workload: Workload,
    runs: dict[str, list[list[dict[str, Any]]]],
    failed: dict[str, str],
    leftovers: list[str],
) -> dict[str, Any]:
    from lightning_hpz.bench.workload import parameter_count

    devices = args.devices_per_node
    parameters = parameter_count(workload)
    summaries: dict[str, dict[str, Any]] = {}
    configs_used: dict[str, Any] = {}
    for configuration in args.selected:
        rounds = runs.get(configuration.name)
        if configuration.name in failed or not rounds:
            continue
        tokens_per_step = 2 * devices * workload.tokens_per_rank_step
        summary = res.summarize_run(configuration.name, rounds, tokens_per_step, args.shape.bits_per_second / 8)
        predicted = predicted_cross_node_bytes(configuration, parameters, devices)
        res.add_prediction(summary, *predicted, devices, args.shape.bits_per_second / 8)
        memory = predicted_model_state_bytes(configuration, parameters, devices)
        summary["predicted_model_state_bytes_per_rank"] = memory
        summaries[configuration.name] = summary
        if "deepspeed_config" in rounds[0][0]:
            configs_used[configuration.name] = rounds[0][0]["deepspeed_config"]
    results = {
        "title": f"{args.shape.bandwidth} link, 2 nodes x {devices} CPU processes, {parameters / 1e6:.2f}M params fp32",
        "command": command,
        "link": {"bandwidth": args.shape.bandwidth, "latency": args.shape.latency, "mtu": args.shape.mtu},
        "nodes": 2,
        "devices_per_node": devices,
        "workload": workload.to_dict(),
        "parameter_count": parameters,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "zero3_thresholds": configs.REGATHER_THRESHOLDS,
        "configurations": summaries,
        "failed": failed,
        "loss_agreement": res.loss_agreement(summaries) if summaries else {},
        "headline": res.headline(summaries),
        "raw_engine_config_matches_strategy": _same_config(configs_used, "hpz-event", "deepspeed-hpz"),
        "testbed_leftovers": leftovers,
        "notes": _notes(args),
    }
    res.write_outputs(results, args.out)
    return results


def _round_orders(selected: list[Any], rounds: int) -> list[list[Any]]:
    # Alternate the order so that a slow phase of a shared machine does not always hit the same configurations.
    return [list(selected) if r % 2 == 0 else list(reversed(selected)) for r in range(rounds)]


def _next_port(args: argparse.Namespace) -> int:
    # A fresh rendezvous port per launch: the previous one may still be in TIME_WAIT.
    args.port += 1
    return args.port


def _spec(name: str, workload: Any, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "configuration": name,
        "workload": workload.to_dict(),
        "steps": args.steps,
        "warmup": args.warmup,
        "devices_per_node": args.devices_per_node,
    }


def _same_config(used: dict[str, Any], strategy_name: str, raw_name: str) -> bool | None:
    if strategy_name not in used or raw_name not in used:
        return None
    return used[strategy_name] == used[raw_name]


def _notes(args: argparse.Namespace) -> list[str]:
    return [
        configs.REGATHER_NOTE,
        "Cross-node bytes are the transmit counters of both veth ends over the measured steps (warm-up excluded), "
        f"so they include TCP/IP headers and ACKs (MTU {args.shape.mtu}); per rank = link bytes / world size.",
        "Predictions for the PyTorch peers use the ZeRO setup with the same traffic: FSDP2 full shard = ZeRO-3, "
        "FSDP2 reshard to a node = hpZ, DDP = stage 0 (one all-reduce); gloo reduce-scatters as all-reduces. "
        "FSDP2 HSDP and MiCS: ZeRO-3 sharded within a node, the gradient shard all-reduced across nodes "
        "(ZeroSetup(3, shard_size=devices per node)).",
        "On CPU the hpz_sync modes do the same work: a CPU copy completes before it returns, so there is nothing "
        "to order (the modes differ on GPUs).",
        "link-bound s: the seconds per step the busier direction of the link needs for its bytes at the nominal "
        "rate; the rest of a step is arithmetic, framework overhead, and waiting for the CPU.",
        "Timings come from one run on a shared CPU (other jobs may run alongside): configurations ran one after "
        "the other on the same testbed, so compare them side by side, not with other runs.",
        f"Link latency: {args.shape.latency} added" if args.shape.delay_seconds else "No latency added to the link.",
    ]


class BenchmarkInterrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived: unwind like Ctrl-C so every ``finally`` removes what it made."""


@contextmanager
def signals_end_the_run() -> Iterator[None]:
    def interrupt(signum: int, frame: Any) -> None:
        raise BenchmarkInterrupted(f"signal {signal.Signals(signum).name}")

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
