"""hpz_sync modes side by side on one machine: exact parity with ZeRO-3, stale reads, and the step time of each mode.

    python benchmarks/hpz_sync_modes.py --ranks 4 --steps 20 --bf16 --validate-every 5 --out results/hpz_sync
    python benchmarks/hpz_sync_modes.py --device cpu --ranks 4 --steps 3 --out /tmp/x   # plumbing check on CPU

Runs each configuration (``--configurations``, see :data:`CONFIGURATIONS`) as its own torchrun job with the same
model, data and seed, and writes ``results.json`` and ``results.md``. Every rank trains a stack of wide linear layers
(the first frozen) under ZeRO-3 and, with ``--validate-every``, evaluates a fixed batch under
``torch.inference_mode()`` (as Lightning does on CUDA), through DeepSpeed's own engine with lightning_hpz's ordering
installed (``zero3-stock``: DeepSpeed alone, the reference).

Where the ranks run:

* as many GPUs as ranks: one GPU each, NCCL;
* fewer (one GPU is enough): every rank on GPU 0, over gloo with CUDA tensors (NCCL refuses two ranks on one
  device). DeepSpeed still takes its CUDA code path and the copies and gathers run on real CUDA streams. Collectives
  gloo refuses with CUDA tensors are relayed through host memory; the table names them and ``results.json`` has
  gloo's exact error for each (``benchmarks/shared_gpu.py``);
* ``--device cpu``: CPU processes over gloo (copies are synchronous there: a plumbing check, no timing meaning).

Fewer than four ranks run only the hpZ-1 configurations (``--ranks 1``: DeepSpeed alone against ``hpz1-event`` on a
world of one, under NCCL on a GPU). Every configuration with the package's ordering records, per step, where the
time went (copy, wait, gather; :class:`PhaseTimes`).

On a GPU every hpZ rank counts its stale reads (``benchmarks/stale_read_probe.py``): all-gathers that started before
the secondary copy they read had landed. The ``-late`` configurations start each secondary copy late on the compute
stream, as on a busy GPU: without ordering (``none``) gathers then read stale shards; ``event`` must still read none
and match ZeRO-3 bit for bit.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Configuration:
    hpz: int
    sync: str
    stock: bool = False  # DeepSpeed alone: lightning_hpz's ordering not installed
    late: bool = False  # secondary copies start late on the compute stream (GPU only)


CONFIGURATIONS = {
    "zero3-stock": Configuration(1, "event", stock=True),
    "hpz1-event": Configuration(1, "event"),
    "hpz2-none": Configuration(2, "none"),
    "hpz2-stream": Configuration(2, "stream"),
    "hpz2-event": Configuration(2, "event"),
    "hpz2-none-late": Configuration(2, "none", late=True),
    "hpz2-event-late": Configuration(2, "event", late=True),
}
DEFAULT_CONFIGURATIONS = "zero3-stock,hpz1-event,hpz2-none,hpz2-stream,hpz2-event"
LATE_CYCLES = 20_000_000  # about 10 ms of GPU time before each secondary copy
PROCESS_GROUP_TIMEOUT_S = 90
REPO = Path(__file__).resolve().parents[1]


def worker(args: argparse.Namespace) -> None:
    """One rank of one configuration (started by torchrun)."""
    import warnings

    import torch

    import lightning_hpz.partitioning  # first: it tells DeepSpeed which accelerator to use

    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    configuration = CONFIGURATIONS[args.configuration]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    on_gpu = args.device == "cuda"
    shared_gpu = on_gpu and torch.cuda.device_count() < world
    if shared_gpu:
        os.environ["LOCAL_RANK"] = "0"  # DeepSpeed places the engine and zero.Init on cuda:LOCAL_RANK
    if on_gpu:
        torch.cuda.set_device(0 if shared_gpu else rank)
    import deepspeed

    ordering = None if configuration.stock else lightning_hpz.partitioning.install(configuration.sync)
    timeout = datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S)  # a hung collective ends the job, not the GPU time
    if on_gpu and not shared_gpu:
        deepspeed.init_distributed(dist_backend="nccl", timeout=timeout)
    else:
        # DeepSpeed would bind the gloo group to cuda:LOCAL_RANK (device_id), and torch then splits every new group
        # with a call gloo lacks (perform_nocolor_split), so hpZ's groups could not be built: start the group here,
        # unbound; DeepSpeed adopts a group that exists
        torch.distributed.init_process_group("gloo", timeout=timeout)
        deepspeed.init_distributed(dist_backend="gloo", timeout=timeout)
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    gloo_refused = _prepare_shared_gpu(device) if shared_gpu else {}
    probe = _stale_read_probe(ordering, device, configuration) if on_gpu else None
    phases = None if ordering is None else PhaseTimes(ordering, on_gpu)
    engine = _engine(args, configuration)
    record = _train(args, engine, device, rank, phases)
    record.update(
        backend=torch.distributed.get_backend(),
        shared_gpu=shared_gpu,
        relayed_through_host=gloo_refused,
        host_syncs=0 if ordering is None else ordering.host_syncs,
        events_recorded=0 if ordering is None else ordering.events_recorded,
        stale_reads=None if probe is None else probe.count(),
        gathers_checked=None if probe is None else probe.gathers_checked,
    )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(record))


def _prepare_shared_gpu(device: object) -> dict[str, str]:
    from shared_gpu import probe_gloo_cuda, relay_through_host

    refused = probe_gloo_cuda(device)
    relay_through_host(list(refused))  # before the engine is built; DeepSpeed's saved references are repointed too
    return refused


class PhaseTimes:
    """Where each step's time goes, per hpZ phase: host seconds in the secondary copies (``copy``; of that, the
    ordering's own part, ``copy_sync``: the host stall of ``stream``), in the ordering before each gather of secondaries
    (``wait``; on a GPU also ``wait_device``: how long the gathering stream stalled there), in issuing those gathers
    (``gather_issue``) and in waiting for their results (``gather_wait``). Read once per step, after its synchronize."""

    PHASES = ("copy", "copy_sync", "wait", "wait_device", "gather_issue", "gather_wait")

    def __init__(self, ordering: object, on_gpu: bool) -> None:
        from deepspeed.runtime.zero.partition_parameters import Init

        from lightning_hpz.partitioning import deepspeed_patch

        self.on_gpu = on_gpu
        self.seconds: dict[str, float] = dict.fromkeys(self.PHASES, 0.0)
        self.stalls: list[tuple[object, object]] = []
        self.steps: list[dict[str, float]] = []
        copy = Init._partition_param_sec
        Init._partition_param_sec = lambda *a, **k: self._timed("copy", copy, *a, **k)
        after_copy, before_gather = ordering.after_secondary_copy, ordering.before_secondary_gather
        ordering.after_secondary_copy = lambda *a: self._timed("copy_sync", after_copy, *a)
        ordering.before_secondary_gather = lambda secondaries: self._wait(before_gather, list(secondaries))
        ordered_gather = deepspeed_patch.ordered_gather
        deepspeed_patch.ordered_gather = lambda gather: self._timed_gather(ordered_gather(gather))

    def _timed(self, phase: str, call: object, *args: object, **kwargs: object) -> object:
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            self.seconds[phase] += time.perf_counter() - start

    def _wait(self, before_gather: object, secondaries: list) -> None:
        import torch

        if not self.on_gpu or not secondaries:
            return self._timed("wait", before_gather, secondaries)
        reached, passed = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reached.record()  # on the gathering stream, as the ordering's waits
        self._timed("wait", before_gather, secondaries)
        passed.record()
        self.stalls.append((reached, passed))
        return None

    def _timed_gather(self, gather: object) -> object:
        def timed_gather(params: object, *args: object, **kwargs: object) -> object:
            params = list(params)
            if not any(getattr(p, "ds_secondary_tensor", None) is not None for p in params):
                return gather(params, *args, **kwargs)
            handle = self._timed("gather_issue", gather, params, *args, **kwargs)
            wait = getattr(handle, "wait", None)
            if wait is not None:
                with contextlib.suppress(AttributeError):  # a handle class with __slots__ is left untimed
                    handle.wait = lambda *a, **k: self._timed("gather_wait", wait, *a, **k)
            return handle

        for mark, value in vars(gather).items():  # the package's marks (an ordered gather) stay visible
            setattr(timed_gather, mark, value)
        return timed_gather

    def start_step(self) -> None:
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self.stalls = []

    def end_step(self, step_seconds: float) -> None:
        """After the step's synchronize: every event pair has completed."""
        self.seconds["wait_device"] = sum(a.elapsed_time(b) for a, b in self.stalls) / 1000.0
        self.steps.append({"step": step_seconds, **self.seconds})


def _stale_read_probe(ordering: object, device: object, configuration: Configuration) -> object:
    from stale_read_probe import StaleReadProbe, delay_copies

    if ordering is None:
        return None
    if configuration.late:
        delay_copies(LATE_CYCLES)
    return StaleReadProbe(ordering, device)


def _engine(args: argparse.Namespace, configuration: Configuration) -> object:
    import deepspeed
    import torch

    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {
            "stage": 3, "zero_hpz_partition_size": configuration.hpz, "stage3_max_live_parameters": 0,
            "stage3_max_reuse_distance": 0, "stage3_param_persistence_threshold": 0,
        },
        "bf16": {"enabled": args.bf16},
    }  # fmt: skip
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        layers = [torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.GELU()) for _ in range(8)]
        model = torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 1))
    # a frozen layer: DeepSpeed never drops its secondary shard, so one made under inference_mode lives on in training
    model[0].requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=config)
    return engine


def _train(args: argparse.Namespace, engine: object, device: object, rank: int, phases: object = None) -> dict:
    import torch

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    generator = torch.Generator().manual_seed(1000 + rank)
    held_out = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(7)).to(device, dtype)
    losses, val_losses, times = [], [], []
    for step in range(args.steps):
        x = torch.randn(args.batch, args.width, generator=generator).to(device, dtype)
        if phases is not None:
            phases.start_step()
        start = time.perf_counter()
        loss = (engine(x) - x[:, :1]).pow(2).mean()
        engine.backward(loss)
        engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if phases is not None:
            phases.end_step(times[-1])
        losses.append(loss.float().item())
        if args.validate_every and (step + 1) % args.validate_every == 0:
            with torch.inference_mode():  # Lightning's evaluation context on CUDA
                val_losses.append((engine(held_out) - held_out[:, :1]).pow(2).mean().float().item())
    return {"losses": losses, "val_losses": val_losses, "times": times, **({"phases": phases.steps} if phases else {})}


def run_configuration(args: argparse.Namespace, name: str) -> dict:
    """One configuration's job; a job that fails gives its exit code and the end of its output instead.

    The job runs in a process group of its own, killed whole on a timeout: ranks left behind would hold the GPU.
    The ranks import this checkout's lightning_hpz, whatever is installed.
    """
    out = Path(args.out) / name
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}", __file__,
        "--worker", "--configuration", name, "--device", args.device, "--steps", str(args.steps),
        "--width", str(args.width), "--batch", str(args.batch), "--validate-every", str(args.validate_every),
        "--out", str(out), *(["--bf16"] if args.bf16 else []),
    ]  # fmt: skip
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                           start_new_session=True)  # fmt: skip
    try:
        output, _ = job.communicate(timeout=args.job_timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        output, _ = job.communicate()
        return {"error": f"timed out after {args.job_timeout} s", "output": (output or "")[-3000:]}
    if job.returncode != 0 or not (out / "rank0.json").is_file():
        return {"error": f"exit code {job.returncode}", "output": (output or "")[-3000:]}
    return json.loads((out / "rank0.json").read_text())


def summarize(results: dict[str, dict], warmup: int) -> str:
    reference = next(iter(results.values()))
    header = ["configuration", "backend", "median step (s)", "host syncs", "events", "stale reads", "= first row",
              "final loss"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for name, record in results.items():
        if "error" in record:
            lines.append(f"| {name} | failed: {record['error']} |" + " |" * (len(header) - 2))
            continue
        times = sorted(record["times"][warmup:]) or record["times"]
        backend = record["backend"] + (" (one GPU)" if record["shared_gpu"] else "")
        relayed = record["relayed_through_host"]
        backend += f", relayed: {', '.join(relayed)}" if relayed else ""
        parity = "yes" if same_numbers(record, reference) else "no"
        lines.append(
            f"| {name} | {backend} | {statistics.median(times):.4f} | {record['host_syncs']} | "
            f"{record['events_recorded']} | {record['stale_reads']} | {parity} | {record['losses'][-1]:.6g} |"
        )
    return "\n".join(lines)


def same_numbers(record: dict, reference: dict) -> bool:
    """Bit-identical training and validation losses (both runs completed)."""
    if "error" in record or "error" in reference:
        return False
    return record["losses"] == reference["losses"] and record["val_losses"] == reference["val_losses"]


def refuse_bad_arguments(args: argparse.Namespace) -> None:
    """Stop before launching any job: without CUDA every rank would fail and the summary would divide by zero."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit(
            "hpz_sync_modes.py: --device cuda (the default) needs a CUDA GPU, and torch sees none. "
            "Run it on a GPU machine, or pass --device cpu for a plumbing check (CPU copies are synchronous, so "
            "the modes do not differ in time there)."
        )
    unknown = [name for name in args.configurations.split(",") if name not in CONFIGURATIONS]
    if unknown:
        sys.exit(f"hpz_sync_modes.py: unknown configurations {unknown}; choose from {sorted(CONFIGURATIONS)}.")
    with_hpz = [name for name in args.configurations.split(",") if CONFIGURATIONS[name].hpz > 1]
    if with_hpz and (args.ranks < 4 or args.ranks % 2):
        sys.exit(
            f"hpz_sync_modes.py: --ranks {args.ranks}: hpZ 2 ({', '.join(with_hpz)}) needs an even number of ranks, "
            "at least 4; fewer ranks run only hpZ 1 configurations (zero3-stock, hpz1-event)."
        )


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--bf16", action="store_true", help="bf16 weights and activations (DeepSpeed's bf16 mode)")
    parser.add_argument("--validate-every", type=int, default=0, help="evaluate under inference_mode every N steps")
    parser.add_argument("--configurations", default=DEFAULT_CONFIGURATIONS, help="comma-separated, first = reference")
    parser.add_argument("--job-timeout", type=float, default=120, help="seconds one configuration may take")
    parser.add_argument("--out", default="results/hpz_sync_modes")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--configuration", default="hpz2-event", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, dict]:
    args = parse_arguments(argv)
    if args.worker:
        worker(args)
        return {}
    refuse_bad_arguments(args)
    results: dict[str, dict] = {}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for name in args.configurations.split(","):
        results[name] = run_configuration(args, name)
        # after each job: a later hang or kill loses nothing already measured
        (Path(args.out) / "results.json").write_text(json.dumps(results, indent=1))
    table = summarize(results, warmup=min(5, args.steps // 5))
    (Path(args.out) / "results.md").write_text(table + "\n")
    print(table)
    return results


if __name__ == "__main__":
    main()
