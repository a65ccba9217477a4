"""GPU acceptance of lightning_hpz: one command, a pass/fail table, a few minutes on one GPU (under 8).

    python benchmarks/gpu_acceptance.py --out results/gpu_acceptance

What a CPU cannot show, checked on the GPU itself:

* ``ordering_on_cuda_streams``: a secondary copy made late on the compute stream (``torch.cuda._sleep`` before it) is
  read by an all-gather stand-in on a side stream, through DeepSpeed's CUDA accelerator: ``"none"`` must read the
  stale shard (the race of arXiv 2407.01614, reproduced), ``"event"`` and ``"stream"`` the copy; host syncs per mode.
* ``collectives_under_nccl``: every helper of :mod:`lightning_hpz.collectives` on a one-rank NCCL group, fed CPU
  tensors as the package's callers do (NCCL refuses CPU tensors unless the helper moves them).
* ``trainer_on_one_gpu``: ``Trainer(strategy=HpzStrategy(stage=3))`` on one GPU with ``TokenThroughputMonitor``
  (its ``setup`` asks the peak FLOP/s of this chip), ``LossStabilityMonitor`` and the integrity check every step,
  then ``refresh_secondary_partitions``: every collective of those paths under NCCL.
* ``hpz_ranks``: ``benchmarks/hpz_sync_modes.py`` with 4 ranks and hpZ 2, one GPU each on a machine with 4+ GPUs,
  else all four on GPU 0 over gloo with CUDA tensors (NCCL refuses two ranks on one GPU; what gloo refuses is relayed
  through host memory and named, with gloo's exact error in the JSON). DeepSpeed's CUDA code path, real CUDA streams,
  bf16, 20 steps with validation under ``torch.inference_mode()`` every 5: ``event`` bit-identical to hpZ 1 and to
  DeepSpeed's own ZeRO-3, also with every secondary copy started late; ``none`` with late copies reads stale
  secondaries (counted on the device); the step time of ``event`` against ``stream``.

* ``litgpt_loops_on_one_gpu``: LitGPT's own ``pretrain.main`` and ``finetune.full.main`` (unmodified, as
  tests/test_litgpt_loops.py drives them on 4 CPU processes) on ``Fabric(accelerator="cuda", devices=1,
  strategy=HpzFabricStrategy(stage=3))`` against the same loops under DDP: losses within 1e-3 (the suite's bound),
  the engine stepped.
* ``initial_weights_on_one_gpu``: the package's Llama-2 and T5 presets and a user's module built under ZeRO-1 and
  ZeRO-3 (``zero.Init`` allocating on the GPU): bit-identical initial parameters and the same first loss.

Without CUDA each of those is reported SKIP with the reason, and the same harnesses run on the CPU stand-ins
(``*_plumbing`` rows: the emulated asynchronous device, gloo, ``accelerator="cpu"``), so the script itself is tested
anywhere; with CUDA the stand-ins are left out (``--plumbing`` runs them too). Exit status 1 if any check failed.
The CUDA checks also run as ``pytest -m cuda tests/test_gpu_acceptance.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

MODES = ("none", "event", "stream")
SLEEP_CYCLES = 200_000_000  # about 0.1 s of GPU time before the copy: far longer than a side-stream read takes
REPO = Path(__file__).resolve().parents[1]


@dataclass
class CheckResult:
    name: str
    status: str  # PASS, FAIL or SKIP
    detail: str
    seconds: float = 0.0


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# ----------------------------------------------------------------------------------------------- stream ordering
def _cuda_read_after_late_copy(mode: str) -> tuple[bool, int]:
    """Whether a side-stream read saw the late copy, and how many host syncs the ordering made."""
    from deepspeed.accelerator import get_accelerator

    from lightning_hpz.partitioning import CopyOrdering

    ordering = CopyOrdering(mode, get_accelerator())
    secondary = torch.zeros(1 << 20, device="cuda")
    values = torch.full_like(secondary, 7.0)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)  # the compute stream is busy: the copy below lands late
    secondary.copy_(values)
    ordering.after_secondary_copy(secondary)
    with torch.cuda.stream(side):  # the all-gather stream of DeepSpeed's prefetch coordinator
        ordering.before_secondary_gather([secondary])
        read = secondary.clone()
    torch.cuda.synchronize()
    return bool(torch.equal(read, values)), ordering.host_syncs


def _emulated_read_after_late_copy(mode: str) -> tuple[bool, int]:
    """The same harness on the CPU stand-in for an asynchronous device."""
    from lightning_hpz.partitioning import CopyOrdering
    from lightning_hpz.partitioning.emulation import EmulatedAsyncDevice

    device = EmulatedAsyncDevice()
    ordering = CopyOrdering(mode, device)
    secondary = torch.full((1024,), 7.0)
    device.defer_copy(secondary)  # issued, lands only when something orders after it
    ordering.after_secondary_copy(secondary)
    ordering.before_secondary_gather([secondary])
    read = secondary.clone()
    return bool(torch.equal(read, torch.full_like(read, 7.0))), ordering.host_syncs


def _judge_ordering(read_after_late_copy: Callable[[str], tuple[bool, int]]) -> tuple[str, str]:
    seen = {mode: read_after_late_copy(mode) for mode in MODES}
    expected = {"none": False, "event": True, "stream": True}
    expected_syncs = {"none": 0, "event": 0, "stream": 1}
    ok = all(seen[m][0] == expected[m] and seen[m][1] == expected_syncs[m] for m in MODES)
    detail = ", ".join(
        f"{m}: {'copy' if seen[m][0] else 'stale'} ({seen[m][1]} host sync{'s' * (seen[m][1] != 1)})" for m in MODES
    )
    return ("PASS" if ok else "FAIL"), detail


def ordering_on_cuda_streams() -> tuple[str, str]:
    return _judge_ordering(_cuda_read_after_late_copy)


def ordering_plumbing() -> tuple[str, str]:
    return _judge_ordering(_emulated_read_after_late_copy)


# ----------------------------------------------------------------------------------------------- collectives
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _one_rank_group(backend: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.distributed.init_process_group(backend, rank=0, world_size=1)


def _collectives_on(backend: str) -> tuple[str, str]:
    from lightning_hpz import collectives

    if backend == "nccl":
        torch.cuda.set_device(0)
    _one_rank_group(backend)
    try:
        on_cpu = torch.tensor([1.0, 2.0])
        reduced = collectives.all_reduce(on_cpu, op="max")
        gathered = collectives.all_gather_tensor(on_cpu)
        results = {
            "device": str(collectives.collective_device()),
            "all_reduce": reduced.tolist() == [1.0, 2.0] and reduced.device == on_cpu.device,
            "all_reduce_values": collectives.all_reduce_values([3.0]) == [3.0],
            "all_gather_tensor": [t.tolist() for t in gathered] == [[1.0, 2.0]] and gathered[0].device.type == "cpu",
            "all_gather_object": collectives.all_gather_object({"a": 1}) == [{"a": 1}],
            "broadcast_object": collectives.broadcast_object("x") == "x",
            "timed_all_gather": _probe_helpers_work(collectives),  # the autotuner's link probe
        }
        collectives.barrier()
    finally:
        torch.distributed.destroy_process_group()
    failed = [name for name, ok in results.items() if ok is False]
    return ("FAIL" if failed else "PASS"), f"tensors on {results['device']}; failed: {failed or 'none'}"


def _probe_helpers_work(collectives: object) -> bool:
    group = collectives.new_subgroups([[0]])
    try:
        seconds = collectives.timed_all_gather(1 << 20, group)
        buffers = collectives.gather_buffers(1 << 20, group)  # the probe's repeats re-use theirs
        again = collectives.timed_all_gather(1 << 20, group, buffers)
        placed = all(b.device.type == collectives.collective_device(group).type for b in buffers)
    finally:
        collectives.destroy_group(group)
    return 0 < seconds < 10 and 0 < again < 10 and placed


def collectives_under_nccl() -> tuple[str, str]:
    return _collectives_on("nccl")


def collectives_plumbing() -> tuple[str, str]:
    return _collectives_on("gloo")


# ----------------------------------------------------------------------------------------------- one-device Trainer
def _fit_one_device(accelerator: str, out: Path) -> tuple[str, str]:
    import lightning as L
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_hpz
    from lightning_hpz.callbacks import LossStabilityMonitor, SecondaryPartitionCheck, TokenThroughputMonitor

    class Regressor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 1))
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=generator)
    data = DataLoader(TensorDataset(x, x[:, :1].tanh()), batch_size=16)
    throughput, integrity = TokenThroughputMonitor(flops_per_token=1e3, window_size=2), SecondaryPartitionCheck(1)
    stability = LossStabilityMonitor(dirpath=str(out / "stability"))
    strategy = lightning_hpz.HpzStrategy(stage=3)
    trainer = L.Trainer(
        accelerator=accelerator, devices=1, strategy=strategy, max_steps=8, log_every_n_steps=1, default_root_dir=out,
        callbacks=[throughput, stability, integrity], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    model = Regressor()
    trainer.fit(model, data)
    dropped = lightning_hpz.refresh_secondary_partitions(model)
    torch.distributed.destroy_process_group()
    ok = len(model.losses) == 8 and all(map(math.isfinite, model.losses)) and integrity.checks_run == 8
    ok = ok and bool(throughput.history)
    name = torch.cuda.get_device_name(0) if accelerator == "cuda" else "cpu"
    peak = (
        "no MFU (chip unknown)" if throughput.peak_flops is None else f"peak {throughput.peak_flops / 1e12:.0f} TFLOP/s"
    )
    detail = (
        f"{name}: {len(model.losses)} steps, last loss {model.losses[-1]:.4g}, {integrity.checks_run} integrity "
        f"checks, {len(throughput.history)} throughput logs, {peak}, refresh dropped {dropped}"
    )
    return ("PASS" if ok else "FAIL"), detail


def trainer_on_one_gpu(out: Path) -> tuple[str, str]:
    return _fit_one_device("cuda", out)


def trainer_plumbing(out: Path) -> tuple[str, str]:
    return _fit_one_device("cpu", out)


# ----------------------------------------------------------------------------------------------- several ranks
RANKS_CONFIGURATIONS = "zero3-stock,hpz1-event,hpz2-event,hpz2-stream,hpz2-none-late,hpz2-event-late"
EXACT = ("hpz1-event", "hpz2-event", "hpz2-event-late")  # bit-identical to DeepSpeed's own ZeRO-3


def hpz_ranks(out: Path, gpus: int) -> tuple[str, str]:
    """hpZ 2 on 4 ranks (one GPU each with 4+ GPUs, else all on GPU 0 over gloo): 20 bf16 steps, validation under
    ``inference_mode`` every 5, against DeepSpeed alone; stale reads counted on the real streams; event vs stream."""
    target = out / "hpz_sync_modes"
    command = [sys.executable, str(REPO / "benchmarks" / "hpz_sync_modes.py"), "--ranks", "4", "--steps", "20"]
    command += ["--bf16", "--validate-every", "5", "--width", "1024", "--configurations", RANKS_CONFIGURATIONS]
    command += ["--job-timeout", "75", "--out", str(target)]
    subprocess.run(command, check=True, timeout=480, cwd=REPO)  # its jobs import this checkout (run_configuration)
    return judge_hpz_ranks(json.loads((target / "results.json").read_text()))


def judge_hpz_ranks(results: dict[str, dict]) -> tuple[str, str]:
    failed = {name: r["error"] for name, r in results.items() if "error" in r}
    if failed:
        return "FAIL", f"jobs failed: {failed} (their output is in results.json)"
    reference = results["zero3-stock"]
    exact = {name: results[name]["losses"] == reference["losses"] and results[name]["val_losses"] == reference[
        "val_losses"] for name in EXACT}  # fmt: skip
    stale = {name: results[name]["stale_reads"] for name in ("hpz2-none-late", *EXACT[1:])}
    probed = all(results[name]["gathers_checked"] for name in stale)  # 0 stale of 0 gathers checked proves nothing
    ordered = probed and stale["hpz2-none-late"] > 0 and all(stale[name] == 0 for name in EXACT[1:])
    event, stream = (_median(results[name]["times"]) for name in ("hpz2-event", "hpz2-stream"))
    where = results["hpz2-event"]["backend"] + (" on one GPU" if results["hpz2-event"]["shared_gpu"] else "")
    relayed = results["hpz2-event"]["relayed_through_host"]
    detail = (
        f"4 ranks, {where}{f', relayed through host: {relayed}' if relayed else ''}; bit-identical to ZeRO-3 "
        f"(train + inference_mode validation, bf16): {exact}; stale reads: {stale} (gathers probed: {probed}); "
        f"median step event "
        f"{event:.4f} s, stream {stream:.4f} s (event/stream {event / stream:.2f})"
    )
    return ("PASS" if all(exact.values()) and ordered else "FAIL"), detail


def _median(times: list[float]) -> float:
    settled = sorted(times[5:]) or sorted(times)
    return settled[len(settled) // 2]


# ----------------------------------------------------------------------------------------------- real clients
SCRIPTS = REPO / "tests" / "scripts"
LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")


def _run_script(name: str, options: dict, out: Path, timeout: float = 240) -> dict[int, dict]:
    """A test script of the suite as a user runs it (``python script.py``), one process; its per-rank records."""
    out.mkdir(parents=True, exist_ok=True)
    # a fresh job: not the rendezvous of the one-device Trainer run earlier in this process (its port is still held)
    env = {key: value for key, value in os.environ.items() if key not in LAUNCH_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    command = [sys.executable, str(SCRIPTS / name), json.dumps({**options, "out": str(out)})]
    done = subprocess.run(command, timeout=timeout, cwd=out.parent, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name} exited {done.returncode}: {(done.stdout + done.stderr)[-1500:]}")
    return {int(path.stem.removeprefix("rank")): json.loads(path.read_text()) for path in out.glob("rank*.json")}


def _logged_losses(record: dict) -> list[float]:
    return [entry["loss"] for entry in record["logged"] if "loss" in entry]


def _loop_against_ddp(script: str, options: dict, out: Path) -> tuple[bool, str]:
    on_gpu = {"accelerator": "cuda", "devices": 1, **options}
    hpz = _run_script(script, {**on_gpu, "strategy": "hpz", "hpz": 1}, out / f"{script[:-3]}_hpz")[0]
    ddp = _run_script(script, {**on_gpu, "strategy": "ddp"}, out / f"{script[:-3]}_ddp")[0]
    losses, reference = _logged_losses(hpz), _logged_losses(ddp)
    worst = max((abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=False)), default=math.inf)
    ok = len(losses) == len(reference) > 1 and all(map(math.isfinite, losses)) and losses[-1] < losses[0]
    ok = ok and worst < 1e-3 and hpz["global_steps"] > 0
    trend = f"{len(losses)} losses {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "no losses"
    return ok, f"{script}: {trend}, worst relative gap to DDP {worst:.1e}"


def litgpt_loops_on_one_gpu(out: Path) -> tuple[str, str]:
    pretrain_ok, pretrain = _loop_against_ddp("litgpt_pretrain.py", {"iterations": 8, "initial_checkpoint": True}, out)
    finetune_ok, finetune = _loop_against_ddp("litgpt_finetune.py", {"steps": 6}, out)
    return ("PASS" if pretrain_ok and finetune_ok else "FAIL"), f"{pretrain}; {finetune}"


def initial_weights_on_one_gpu(out: Path) -> tuple[str, str]:
    stages = {"zero1": {"stage": 1, "hpz_partition_size": 1}, "zero3": {"stage": 3, "hpz_partition_size": 1}}
    families = {"llama2": ({"preset": "llama2-tiny"}, {"sequence_length": 64, "batch_size": 4}),
                "t5": ({"preset": "t5-tiny"}, {"input_length": 64, "batch_size": 4}),
                "user": ({}, {"sequence_length": 64, "batch_size": 4})}  # fmt: skip
    jobs = [{"name": f"{family}/{stage}", "family": family, "steps": 1, "initial_state": True, "strategy": settings,
             "model": model, "data": {"source": "default", **data}}
            for family, (model, data) in families.items() for stage, settings in stages.items()]  # fmt: skip
    options = {"accelerator": "cuda", "devices": 1, "strategy": stages["zero1"], "jobs": jobs}
    records = _run_script("model_training.py", options, out / "initial_weights")[0]["jobs"]
    (out / "initial_weights_digests.json").write_text(json.dumps(records))  # compared with a CPU run afterwards
    verdicts = []
    for family in families:
        one, three = records[f"{family}/zero1"], records[f"{family}/zero3"]
        same = one["parameter_digests"] == three["parameter_digests"] and one["losses"][0] == three["losses"][0]
        verdicts.append((family, same, one["losses"][0], three["losses"][0]))
    detail = "; ".join(f"{f}: {'identical' if same else 'DIFFERENT'} (first loss {a:.5f} vs {b:.5f})"
                       for f, same, a, b in verdicts)  # fmt: skip
    return ("PASS" if all(same for _, same, _, _ in verdicts) else "FAIL"), detail


# ----------------------------------------------------------------------------------------------- driver
def _run(name: str, check: Callable[[], tuple[str, str]]) -> CheckResult:
    start = time.perf_counter()
    try:
        status, detail = check()
    except Exception as err:  # a crash is a failed check, reported in the table with its cause
        status, detail = "FAIL", f"{type(err).__name__}: {err}"
        traceback.print_exc()
    return CheckResult(name, status, detail, time.perf_counter() - start)


def run_checks(out: Path, plumbing: bool = True, only: tuple[str, ...] = ()) -> list[CheckResult]:
    gpus = gpu_count()
    results = []
    cuda_checks = [
        ("ordering_on_cuda_streams", ordering_on_cuda_streams),
        ("collectives_under_nccl", collectives_under_nccl),
        ("trainer_on_one_gpu", lambda: trainer_on_one_gpu(out)),
    ]
    cuda_checks.append(("litgpt_loops_on_one_gpu", lambda: litgpt_loops_on_one_gpu(out)))
    cuda_checks.append(("initial_weights_on_one_gpu", lambda: initial_weights_on_one_gpu(out)))
    cuda_checks.append(("hpz_ranks", lambda: hpz_ranks(out, gpus)))  # the longest: last
    cuda_checks = [(name, check) for name, check in cuda_checks if not only or name in only]
    for name, check in cuda_checks:
        results.append(_run(name, check) if gpus else CheckResult(name, "SKIP", "no CUDA device on this machine"))
        print(table(results[-1:]), flush=True)  # each row as it comes: a run stopped at its time limit keeps them
    if plumbing:
        for name, check in (("ordering_plumbing", ordering_plumbing), ("collectives_plumbing", collectives_plumbing)):
            results.append(_run(name, check))
        results.append(_run("trainer_plumbing", lambda: trainer_plumbing(out)))
    return results


def table(results: list[CheckResult]) -> str:
    lines = ["| check | result | seconds | detail |", "| --- | --- | --- | --- |"]
    lines += [f"| {r.name} | {r.status} | {r.seconds:.1f} | {r.detail} |" for r in results]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/gpu_acceptance", help="where results.json and results.md go")
    parser.add_argument("--no-plumbing", action="store_true", help="skip the CPU stand-ins of the CUDA checks")
    parser.add_argument("--plumbing", action="store_true", help="run the CPU stand-ins on a CUDA machine too")
    parser.add_argument("--only", default="", help="comma-separated names of the CUDA checks to run (default: all)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("No CUDA device: the CUDA checks are skipped; running their CPU stand-ins (plumbing) only.")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # on a GPU the real checks replace their CPU stand-ins, which would only spend device-machine time
    plumbing = args.plumbing or (not args.no_plumbing and not torch.cuda.is_available())
    results = run_checks(out, plumbing=plumbing, only=tuple(filter(None, args.only.split(","))))
    (out / "results.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    (out / "results.md").write_text(table(results) + "\n")
    print(table(results))
    return 1 if any(r.status == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
