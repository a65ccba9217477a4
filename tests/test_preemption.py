"""Preemption on real processes: a SIGTERM or SIGUSR1 mid-training commits a checkpoint and exits 75, never 0 and
never a deadlock; the resumed run continues exactly. Under Lightning's launcher, torchrun and a SLURM-style launch (the
uninterrupted reference and the resume fork their ranks from the warm launcher)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import SCRIPTS, WARM
from warm_launcher import free_port

from lightning_hpz.lifecycle.preemption_checkpoint import next_preemption_checkpoint
from lightning_hpz.lifecycle.run_exit import PREEMPTED_EXIT_CODE, PreemptionSignals

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SCRIPT = str(SCRIPTS / "preemption_training.py")
STEPS = 16
_WAITER = ThreadPoolExecutor(1)  # the warm launches, one after another, while the launched ones are preempted


def _launch(command: list[str], out: Path, env: dict | None = None) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / f"log-{len(list(out.glob('log-*')))}.txt", "w")  # noqa: SIM115 - closed with the process
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=out)


def _options(out: Path, **extra) -> str:
    return json.dumps({"out": str(out), "steps": STEPS, "stage": 3, **extra})


def _record(out: Path, rank: int) -> dict:
    return json.loads((out / f"rank{rank}.json").read_text())


def _wait_for_step(out: Path, step: int, processes: list[subprocess.Popen], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if _record(out, 0)["step"] >= step:
                return
        except (OSError, ValueError, KeyError):
            pass
        assert all(p.poll() is None for p in processes), "training ended before it was signalled"
        time.sleep(0.1)
    raise AssertionError(f"rank 0 did not reach step {step} in {timeout} s")


def _preempt(processes: list[subprocess.Popen], out: Path, signum: int) -> tuple[list[int], float]:
    _wait_for_step(out, 3, processes)
    sent = time.monotonic()
    for process in processes:
        process.send_signal(signum)
    codes = [process.wait(timeout=240) for process in processes]
    return codes, time.monotonic() - sent


def _warm(out: Path, **extra) -> Future:
    """A 2-rank run of the script forked from the warm launcher (the reference and the resume: what they check is the
    training, not the launcher), in the background; its exit code once it ends, its output in ``log-0.txt``."""
    out.mkdir(parents=True, exist_ok=True)

    def run() -> int:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        code, output = WARM.run(SCRIPT, [_options(out, **extra)], str(out), env, 2, 600)
        (out / "log-0.txt").write_text(output)
        return code

    return _WAITER.submit(run)


@pytest.fixture(scope="module")
def runs(module_tmp: Path) -> dict:
    results: dict = {}
    base = module_tmp / "uninterrupted"
    # the reference runs alongside the preempted launches (they mostly sleep between steps); nothing of it is timed
    uninterrupted = _warm(base, step_seconds=0)

    lightning = module_tmp / "lightning"
    main = _launch([sys.executable, SCRIPT, _options(lightning, step_seconds=0.3)], lightning)
    results["lightning"] = _preempt([main], lightning, signal.SIGTERM)
    checkpoint = _record(lightning, 0)["checkpoint"]
    resumed = _warm(module_tmp / "resumed", step_seconds=0, resume_from=checkpoint)

    torchrun = module_tmp / "torchrun"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT]
    agent = _launch([*command, _options(torchrun, step_seconds=0.3)], torchrun)
    results["torchrun"] = _preempt([agent], torchrun, signal.SIGTERM)

    results["slurm"] = _slurm_run(module_tmp / "slurm")
    results["uninterrupted"], results["resumed"] = uninterrupted.result(600), resumed.result(600)
    results.update(base=base, lightning_out=lightning, resumed_out=module_tmp / "resumed", torchrun_out=torchrun)
    return results


def _slurm_run(out: Path) -> tuple[list[int], float]:
    """Two tasks started the way srun starts them (SLURM_* variables, no Lightning launcher); SLURM's --signal=USR1."""
    fake_bin = out / "bin"
    fake_bin.mkdir(parents=True)
    scontrol = fake_bin / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {out}/scontrol-calls.txt\n')
    scontrol.chmod(0o755)
    common = {
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_NNODES": "1",
        "SLURM_NODEID": "0",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "hpz-preemption-test",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}",
    }
    tasks = [
        _launch(
            [sys.executable, SCRIPT, _options(out, step_seconds=0.3)],
            out,
            {**common, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)},
        )
        for rank in range(2)
    ]
    return _preempt(tasks, out, signal.SIGUSR1)


def test_sigterm_under_lightning_launcher_exits_75_with_a_committed_checkpoint(runs):
    (code,), seconds = runs["lightning"]
    assert code == PREEMPTED_EXIT_CODE, (runs["lightning_out"] / "log-0.txt").read_text()[-3000:]
    assert seconds < 120
    records = [_record(runs["lightning_out"], rank) for rank in (0, 1)]
    assert records[0]["step"] == records[1]["step"] < STEPS, "both ranks stopped at the same step, before the end"
    checkpoint = Path(records[0]["checkpoint"])
    assert checkpoint.name == "hpc_ckpt_1.ckpt" and (checkpoint / "latest").is_file()


def test_resume_from_the_preemption_checkpoint_continues_exactly(runs):
    assert runs["uninterrupted"] == 0 and runs["resumed"] == 0
    stopped_at = _record(runs["lightning_out"], 0)["step"]
    for rank in (0, 1):
        expected = _record(runs["base"], rank)["losses"]
        before = _record(runs["lightning_out"], rank)["losses"]
        after = _record(runs["resumed_out"], rank)["losses"]
        assert sorted(after, key=int) == [str(s) for s in range(stopped_at, STEPS)]
        assert {**before, **after} == expected, f"rank {rank}: the preempted+resumed run differs"


def test_sigterm_under_torchrun_exits_nonzero_after_every_worker_saved(runs):
    (code,), seconds = runs["torchrun"]
    assert code != 0 and seconds < 120
    records = [_record(runs["torchrun_out"], rank) for rank in (0, 1)]
    assert [r["exit"] for r in records] == [PREEMPTED_EXIT_CODE] * 2
    assert (Path(records[0]["checkpoint"]) / "latest").is_file()


def test_slurm_signal_commits_requeues_and_leaves_a_checkpoint_lightning_resumes_by_itself(runs):
    codes, seconds = runs["slurm"]
    assert seconds < 120
    out = runs["base"].parent / "slurm"
    assert codes == [PREEMPTED_EXIT_CODE] * 2, (out / "log-0.txt").read_text()[-3000:]
    assert (out / "scontrol-calls.txt").read_text().split() == ["requeue", "4242"]
    # Lightning's SLURM auto-resume picks the newest hpc_ckpt_<N>.ckpt in default_root_dir.
    assert sorted(p.name for p in (out / "root").glob("hpc_ckpt_*.ckpt")) == ["hpc_ckpt_1.ckpt"]


def test_next_preemption_checkpoint_numbers_after_the_newest(tmp_path):
    assert Path(next_preemption_checkpoint(tmp_path)).name == "hpc_ckpt_1.ckpt"
    (tmp_path / "hpc_ckpt_1.ckpt").mkdir()
    (tmp_path / "hpc_ckpt_7.ckpt").mkdir()
    assert Path(next_preemption_checkpoint(tmp_path)).name == "hpc_ckpt_8.ckpt"
    assert Path(next_preemption_checkpoint(tmp_path / "missing")).name == "hpc_ckpt_1.ckpt"


def test_signal_handler_only_records_and_is_restored():
    preemption = PreemptionSignals(("SIGUSR1",))
    previous = signal.getsignal(signal.SIGUSR1)
    preemption.install()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert preemption.received == signal.SIGUSR1 and preemption.name == "SIGUSR1"
    preemption.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == previous


def test_unknown_signal_name_is_refused():
    with pytest.raises(ValueError, match="SIGNOPE"):
        PreemptionSignals(("SIGNOPE",))
