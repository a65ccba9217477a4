"""``lightning-hpz plan --probe``: measure this cluster's links and print the autotuner's table, without training.

Run it as the training would run, one process per device on every node (the links measured are the ones between
those processes), e.g. ``torchrun --nnodes 2 --nproc-per-node 8 ... -m lightning_hpz.cli plan --probe --params 7e9``.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

from lightning_hpz.planning.tuning import GIB, FixedSettings, ModelFacts, TrainingFacts, candidates, choose
from lightning_hpz.planning.tuning_decision import TuningDecision

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def probe_main(args: argparse.Namespace, param_count: int) -> None:
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise SystemExit(
            "lightning-hpz plan --probe measures the links between the processes of a run, so it must be started "
            f"like one: under torchrun or an equivalent launcher ({', '.join(missing)} not set). For example, on each "
            "of 2 nodes: torchrun --nnodes 2 --nproc-per-node 8 --node-rank <n> --master-addr <node 0> "
            "-m lightning_hpz.cli plan --probe --params 7e9"
        )
    import torch
    import torch.distributed as dist

    from lightning_hpz import collectives
    from lightning_hpz.autotune.link_probe import probe_links
    from lightning_hpz.autotune.tuner import device_memory_bytes
    from lightning_hpz.planning.communication import ClusterLayout

    world, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if world % local:
        raise SystemExit(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}: give every node as many.")
    layout = ClusterLayout(world // local, local)
    cuda = torch.cuda.is_available() and not args.cpu
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=5))
    try:
        links = probe_links(layout, collectives.rank())
        budget = args.memory_gib * GIB if args.memory_gib else device_memory_bytes(layout.devices_per_node)
        training = TrainingFacts(
            param_bytes=args.param_bytes,
            grad_bytes=args.param_bytes,
            optimizer_bytes_per_param=args.optimizer_bytes,
            gradient_reduction=args.gradient_reduction if cuda else "all_reduce",
        )
        facts = ModelFacts.approximate(param_count)
        found = candidates(facts, layout, links, training, FixedSettings(), budget)
        pick, reason = choose(found, budget)
        decision = TuningDecision.from_choice(pick, found, links, budget, reason, (layout.nodes, local))
        if collectives.rank() == 0:
            print(decision.table())
            print("(the model is taken as 100 equal modules of its parameter count; a real run uses its own modules)")
    finally:
        dist.destroy_process_group()
