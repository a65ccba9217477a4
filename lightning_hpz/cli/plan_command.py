"""``lightning-hpz plan``: predicted communication and memory per rank for each ZeRO stage, hpZ, ZeRO++, FSDP2 HSDP
and DeepSpeed MiCS."""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_hpz.planning.communication import (
    GRADIENT_REDUCTIONS,
    ClusterLayout,
    TrafficEstimate,
    ZeroSetup,
    traffic_per_step,
)
from lightning_hpz.planning.memory import memory_per_rank

GIB = 2**30


@dataclass(frozen=True)
class PlanRow:
    name: str
    zero: ZeroSetup


def plan_rows(devices_per_node: int) -> list[PlanRow]:
    """The configurations the table compares; hpZ shards the secondary copy over one node, FSDP2 HSDP and MiCS the
    model states (a replica per node; MiCS's hierarchical gather applies only to groups spanning nodes)."""
    hpz = devices_per_node
    return [
        PlanRow("DDP", ZeroSetup(0)),
        PlanRow("ZeRO-1", ZeroSetup(1)),
        PlanRow("ZeRO-2", ZeroSetup(2)),
        PlanRow("ZeRO-3", ZeroSetup(3)),
        PlanRow(f"ZeRO-3 + hpZ({hpz})", ZeroSetup(3, hpz)),
        PlanRow(f"ZeRO++ (hpZ({hpz}) + qwZ + qgZ)", ZeroSetup(3, hpz, True, True)),
        PlanRow(f"FSDP2 HSDP (shard {hpz})", ZeroSetup(3, shard_size=hpz)),
        PlanRow(f"MiCS (mics_shard_size={hpz})", ZeroSetup(3, shard_size=hpz)),
    ]


def communication_seconds(
    traffic: TrafficEstimate, layout: ClusterLayout, inter_node_gbps: float, intra_node_gbps: float
) -> float:
    """Seconds per step if nothing overlaps: a node's cross-node bytes over its link, then a rank's intra-node bytes
    over its intra-node link (``traffic`` is per rank; all ranks of a node share the node's network link)."""
    inter = traffic.inter_node_bytes * layout.devices_per_node / (inter_node_gbps * 1e9 / 8)
    intra = traffic.intra_node_bytes / (intra_node_gbps * 1e9 / 8)
    return inter + intra


def preset_parameter_count(name: str) -> int:
    """Parameter count of a model preset of :mod:`lightning_hpz.models`, imported only when asked for."""
    if importlib.util.find_spec("lightning_hpz.models.presets") is None:
        raise SystemExit("--preset needs lightning_hpz.models.presets, which this installation lacks; use --params.")
    from lightning_hpz.models import presets

    if name not in presets.PRESETS:
        raise SystemExit(f"Unknown preset {name!r}. Known presets: {', '.join(sorted(presets.PRESETS))}.")
    return presets.PRESETS[name].parameters


@dataclass(frozen=True)
class PlanEntry:
    name: str
    traffic: TrafficEstimate
    seconds: float
    memory_bytes: float


def plan_entries(args: argparse.Namespace, param_count: int) -> list[PlanEntry]:
    """Each configuration's predicted traffic, communication seconds and memory per rank."""
    layout = ClusterLayout(args.nodes, args.devices_per_node)
    entries = []
    for row in plan_rows(args.devices_per_node):
        if args.nodes == 1 and (row.zero.hpz_partition_size > 1 or row.zero.shard_size is not None):
            continue  # on one node hpZ, HSDP and MiCS are plain ZeRO-3
        traffic = traffic_per_step(
            param_count,
            row.zero,
            layout,
            param_bytes=args.param_bytes,
            grad_bytes=args.param_bytes,
            regather_in_backward=not args.no_regather,
            gradient_reduction=args.gradient_reduction,
        )
        memory = memory_per_rank(
            param_count, row.zero, layout, args.param_bytes, args.optimizer_bytes, grad_bytes=args.param_bytes
        )
        seconds = communication_seconds(traffic, layout, args.inter_node_gbps, args.intra_node_gbps)
        entries.append(PlanEntry(row.name, traffic, seconds, memory.total))
    return entries


def plan_table(args: argparse.Namespace, param_count: int) -> str:
    header = ["configuration", "cross-node GB/rank", "intra-node GB/rank", "comm s/step", "memory GiB/rank"]
    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    for entry in plan_entries(args, param_count):
        cells = [
            entry.name,
            f"{entry.traffic.inter_node_bytes / 1e9:.3f}",
            f"{entry.traffic.intra_node_bytes / 1e9:.3f}",
            f"{entry.seconds:.3f}",
            f"{entry.memory_bytes / GIB:.2f}",
        ]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


# How each configuration of the table is run; the planner compares them all, the strategy runs the DeepSpeed ones.
HOW_TO_RUN = {
    "DDP": "Lightning's DDPStrategy",
    "ZeRO-1": "HpzStrategy(stage=1)",
    "ZeRO-2": "HpzStrategy(stage=2)",
    "ZeRO-3": "HpzStrategy(stage=3, hpz_partition_size=1)",
    "ZeRO-3 + hpZ": 'strategy="hpz" (hpZ over one node by default)',
    "ZeRO++": 'strategy="zeropp" (CUDA only)',
    "FSDP2 HSDP": "FSDP2 fully_shard on a 2-D mesh (replicate across nodes, shard within): Lightning's "
    "ModelParallelStrategy, not this package",
    "MiCS": "DeepSpeed 0.9.2-0.18.x with NCCL (DeepSpeed 0.19 removed MiCS): not this package",
}


def recommendation(args: argparse.Namespace, param_count: int) -> str:
    """The configurations whose model states fit ``--memory-gib``, least communication first, and how to run each."""
    entries = plan_entries(args, param_count)
    fitting = sorted((e for e in entries if e.memory_bytes <= args.memory_gib * GIB), key=lambda e: e.seconds)
    if not fitting:
        least = min(entries, key=lambda e: e.memory_bytes)
        return (
            f"Nothing fits {args.memory_gib:g} GiB per rank: the least memory is {least.name}'s "
            f"{least.memory_bytes / GIB:.2f} GiB of model states. Add nodes, offload the optimizer "
            '(strategy="hpz_offload") or choose a smaller model.'
        )
    lines = [f"Fitting {args.memory_gib:g} GiB per rank (model states only; leave room for activations), least "
             "communication first:"]  # fmt: skip
    for entry in fitting:
        how = HOW_TO_RUN[max((p for p in HOW_TO_RUN if entry.name.split(" (")[0].startswith(p)), key=len)]
        lines.append(f"  {entry.seconds:8.3f} s  {entry.memory_bytes / GIB:7.2f} GiB  {entry.name}: {how}")
    return "\n".join(lines)


def parse_plan_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="lightning-hpz plan",
        description="Predict bytes sent per rank per step (across / within nodes), communication time and memory "
        "per rank (model states) for DDP, ZeRO-1/2/3, hpZ, ZeRO++, FSDP2 HSDP and DeepSpeed MiCS. "
        "Model: lightning_hpz/planning/communication.py.",
    )
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", type=float, help="parameter count, e.g. 7e9")
    size.add_argument("--preset", help="a model preset name of lightning_hpz.models (e.g. llama2-70b)")
    parser.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    parser.add_argument("--devices-per-node", type=int, default=8, help="ranks per node; hpZ shards over them")
    parser.add_argument("--inter-node-gbps", type=float, default=100.0, help="one node's network link, Gbit/s")
    parser.add_argument("--intra-node-gbps", type=float, default=2400.0, help="one device's intra-node link, Gbit/s")
    parser.add_argument("--param-bytes", type=int, default=2, help="bytes per parameter/gradient as communicated")
    parser.add_argument("--optimizer-bytes", type=int, default=12, help="optimizer bytes per parameter (Adam: 12)")
    parser.add_argument("--no-regather", action="store_true", help="ZeRO-3 keeps parameters gathered for backward")
    parser.add_argument("--gradient-reduction", choices=GRADIENT_REDUCTIONS, default="reduce_scatter")
    parser.add_argument(
        "--probe",
        action="store_true",
        help="measure the links between the processes of this launch (start it under torchrun, one process per "
        "device on every node) and print the autotuner's candidates and choice; --nodes, --devices-per-node and "
        "the link speeds then come from the launch and the measurement",
    )
    parser.add_argument(
        "--memory-gib",
        type=float,
        help="memory budget per rank: without --probe, list the configurations that fit, least communication first; "
        "with --probe, the autotuner's budget (default: the device's)",
    )
    parser.add_argument("--cpu", action="store_true", help="--probe: measure over gloo even where CUDA exists")
    args = parser.parse_args(list(argv))
    for name in ("nodes", "devices_per_node", "inter_node_gbps", "intra_node_gbps", "param_bytes"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.params is not None and args.params < 1:
        parser.error(f"--params must be a positive parameter count such as 7e9, got {args.params}")
    return args


def plan_main(argv: Sequence[str] = ()) -> None:
    """Print the plan table for ``argv`` (see ``lightning-hpz plan --help``)."""
    args = parse_plan_args(argv)
    param_count = int(args.params) if args.params is not None else preset_parameter_count(args.preset)
    if args.probe:
        from lightning_hpz.autotune.probe_command import probe_main

        probe_main(args, param_count)
        return
    what = f"{args.preset} " if args.preset else ""
    print(
        f"{what}{param_count / 1e9:.2f}B parameters on {args.nodes} node(s) x {args.devices_per_node} devices, "
        f"{args.inter_node_gbps:g} Gbit/s between nodes, {args.intra_node_gbps:g} Gbit/s within; per optimizer step"
    )
    print(plan_table(args, param_count))
    if args.memory_gib is not None:
        print()
        print(recommendation(args, param_count))
