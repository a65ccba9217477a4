"""hpz_sync modes side by side on one machine: loss parity with plain ZeRO-3 and median step time per mode.

    python benchmarks/hpz_sync_modes.py --ranks 2 --steps 50 --out results/hpz_sync   # on a CUDA machine
    python benchmarks/hpz_sync_modes.py --device cpu --ranks 4 --steps 10 --out /tmp/x  # plumbing check on CPU

Runs plain ZeRO-3 (hpZ off) and hpZ with each of "none", "stream" and "event", one torchrun job each, the same model,
data and seed, and writes ``results.json`` and ``results.md``. With at least ``--ranks`` GPUs each rank gets its own
GPU (NCCL); with fewer, the ranks share the GPUs over gloo (hpZ needs at least two ranks, a single GPU is enough to
see the host stalls of "stream" and the race of "none"). Each job is a few dozen steps of an MLP stack wide enough
for the secondary copies to take measurable time, so the whole comparison takes a few minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONFIGURATIONS = [("zero3", 1, "event"), ("hpz-none", None, "none"), ("hpz-stream", None, "stream"),
                  ("hpz-event", None, "event")]  # fmt: skip


def worker(args: argparse.Namespace) -> None:
    """One rank of one configuration (started by torchrun)."""
    import warnings

    import deepspeed
    import torch

    from lightning_hpz.partitioning import install  # first: it tells DeepSpeed which accelerator to use

    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    on_gpu = args.device == "cuda"
    if on_gpu:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    backend = "nccl" if on_gpu and torch.cuda.device_count() >= world else "gloo"
    deepspeed.init_distributed(dist_backend=backend)
    ordering = install(args.sync)
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {
            "stage": 3, "zero_hpz_partition_size": args.hpz, "stage3_max_live_parameters": 0,
            "stage3_max_reuse_distance": 0, "stage3_param_persistence_threshold": 0,
        },
    }  # fmt: skip
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        layers = [torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.GELU()) for _ in range(8)]
        model = torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 1))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    generator = torch.Generator().manual_seed(1000 + rank)
    losses, times = [], []
    for _ in range(args.steps):
        x = torch.randn(args.batch, args.width, generator=generator).to(engine.device)
        start = time.perf_counter()
        loss = (engine(x) - x[:, :1]).pow(2).mean()
        engine.backward(loss)
        engine.step()
        if on_gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    record = {"losses": losses, "times": times, "events_recorded": ordering.events_recorded,
              "host_syncs": ordering.host_syncs, "backend": backend}  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(record))


def run_configuration(args: argparse.Namespace, name: str, hpz: int, sync: str) -> dict:
    out = Path(args.out) / name
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}", __file__,
        "--worker", "--device", args.device, "--hpz", str(hpz), "--sync", sync, "--steps", str(args.steps),
        "--width", str(args.width), "--batch", str(args.batch), "--out", str(out),
    ]  # fmt: skip
    subprocess.run(command, check=True)
    return json.loads((out / "rank0.json").read_text())


def summarize(results: dict[str, dict], warmup: int) -> str:
    reference = results["zero3"]["losses"]
    header = ["configuration", "median step (s)", "p10-p90 (s)", "host syncs", "events", "= ZeRO-3", "final loss"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for name, record in results.items():
        times = sorted(record["times"][warmup:])
        spread = f"{times[len(times) // 10]:.4f}-{times[(9 * len(times)) // 10]:.4f}"
        parity = "yes" if record["losses"] == reference else "no"
        lines.append(
            f"| {name} | {statistics.median(times):.4f} | {spread} | {record['host_syncs']} | "
            f"{record['events_recorded']} | {parity} | {record['losses'][-1]:.6g} |"
        )
    return "\n".join(lines)


def refuse_missing_cuda(device: str) -> None:
    """Stop before launching any job: without CUDA every rank would fail and the summary would divide by zero."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        sys.exit(
            "hpz_sync_modes.py: --device cuda (the default) needs a CUDA GPU, and torch sees none. "
            "Run it on a GPU machine, or pass --device cpu for a plumbing check (CPU copies are synchronous, so "
            "the modes do not differ in time there)."
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", default="results/hpz_sync_modes")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hpz", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--sync", default="event", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    refuse_missing_cuda(args.device)
    results = {name: run_configuration(args, name, hpz or args.ranks, sync) for name, hpz, sync in CONFIGURATIONS}
    table = summarize(results, warmup=min(5, args.steps // 5))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=1))
    (Path(args.out) / "results.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
