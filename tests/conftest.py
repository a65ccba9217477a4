"""Shared helpers: launch a training script as a user would (one process per rank) and read what each rank wrote.

``run_script`` starts a script through Lightning's own launcher, or, given ``ranks``, as ``torchrun`` would, forked
from the session's warm launcher (``warm_launcher.py``), which saves each rank about 10 s of imports.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from warm_launcher import WarmLauncher, free_port

# Every run the suite launches takes the CUDA branches of Lightning a CPU can take (strategy/testing.py,
# docs/development.md): validate/test/predict under torch.inference_mode, as on every GPU. A test that needs the
# gloo branch passes CUDA_SEMANTICS_OFF to run_script.
os.environ.setdefault("LIGHTNING_HPZ_EMULATE_CUDA_SEMANTICS", "1")
CUDA_SEMANTICS_OFF = {"LIGHTNING_HPZ_EMULATE_CUDA_SEMANTICS": "0"}
SCRIPTS = Path(__file__).parent / "scripts"
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@functools.cache
def import_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module (once per test process), registered under ``name`` in ``sys.modules``,
    where its dataclasses look their module up."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# Parameters are released after forward and re-gathered in backward even for a tiny model, as in a 7B model:
# otherwise DeepSpeed keeps them alive and hpZ is never exercised after the first step.
REGATHER_EVERY_MODULE = {
    "zero_optimization": {
        "stage3_max_live_parameters": 0,
        "stage3_max_reuse_distance": 0,
        "stage3_param_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": 0,
    }
}


class ScriptRun:
    """The outcome of one launched script: return code, output, and each rank's JSON record."""

    def __init__(self, returncode: int, output: str, out: Path) -> None:
        self.returncode = returncode
        self.output = output
        self.ranks = {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))}

    def losses(self, rank: int = 0) -> list[float]:
        record = self.ranks[rank]["losses"]
        return [record[k] for k in sorted(record, key=int)]


def run_script(
    script: str,
    options: dict,
    out: Path,
    timeout: float = 240,
    env: dict | None = None,
    launcher: list[str] | None = None,
    ranks: int | None = None,
) -> ScriptRun:
    """Run ``script`` with ``options`` as a user would: ``python script.py`` (Lightning's launcher starts the other
    ranks), or under ``launcher``, or, given ``ranks``, as ``torchrun --nproc-per-node ranks`` with the ranks forked
    from the session's warm launcher (same code path as torchrun, without 10 s of imports per rank)."""
    options = {**options, "out": str(out)}
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if ranks is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        arguments = [json.dumps(options)]
        code, output = WARM.run(str(SCRIPTS / script), arguments, str(out.parent), full_env, ranks, timeout)
        return ScriptRun(code, output, out)
    command = [*(launcher or [sys.executable]), str(SCRIPTS / script), json.dumps(options)]
    completed = subprocess.run(
        command,
        capture_output=False,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=out.parent,
    )
    return ScriptRun(completed.returncode, completed.stdout, out)


WARM = WarmLauncher()


@pytest.fixture(scope="session", autouse=True)
def _close_warm_launcher():
    yield
    WARM.close()


def assert_succeeded(run: ScriptRun, ranks: int = 4) -> None:
    assert run.returncode == 0, run.output[-4000:]
    assert sorted(run.ranks) == list(range(ranks)), run.output[-4000:]


def universal_state_bytes(copy: Path) -> int:
    """The bytes of the state (fp32 weights and Adam's two moments) in the universal-format ``copy``'s merged files."""
    import torch

    state = 0
    for path in copy.glob("*/zero/*/*.pt"):  # <copy>/checkpoint/zero/<parameter>/<state>.pt
        if path.stem in ("fp32", "exp_avg", "exp_avg_sq"):
            loaded = torch.load(path, weights_only=False, mmap=True)
            tensor = loaded["param"] if isinstance(loaded, dict) else loaded
            state += tensor.numel() * tensor.element_size()
    return state


def assert_read_in_parts(reads: list[dict], state: int) -> None:
    """Each rank's universal load (``strategy.universal_reads``, one dict per rank) mapped the merged files and copied
    its own part of them: the parts add up to the ``state`` bytes once, none above 1.2/N of it."""
    assert all(r["fallback"] == "" and r["files_read_whole"] == 0 and r["files_mapped"] > 0 for r in reads), reads
    assert sum(r["bytes_copied"] for r in reads) == state, (reads, state)
    assert max(r["bytes_copied"] for r in reads) <= 1.2 * state / len(reads), (reads, state)


def launch_nodes(script: str, options: dict, out: Path, nodes: int, env: dict | None = None) -> dict[int, dict]:
    """A multi-node Lightning job on this machine, started as a user starts one: ``python script`` once per node with
    ``NODE_RANK`` and one ``MASTER_ADDR``/``MASTER_PORT`` (Lightning's launcher starts each node's other ranks). Waits
    for every node to succeed; returns each rank's ``rank<r>.json``."""
    ended = run_nodes(script, options, out, nodes, env)
    output = "".join((out / f"node{n}.log").read_text()[-3000:] for n in range(nodes))
    assert [code for code, _ in ended] == [0] * nodes, output
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}


def run_nodes(
    script: str, options: dict, out: Path, nodes: int, env: dict | None = None, timeout: float = 300
) -> list[tuple[int, float]]:
    """:func:`launch_nodes` without judging the outcome: each node's exit code and when it ended
    (``time.monotonic``); its output is in ``out/node<n>.log``. Each node is its own launcher, as on a cluster: one
    that fails ends no other."""
    command = [sys.executable, str(SCRIPTS / script), json.dumps({**options, "out": str(out)})]
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"}
    base.update(env or {})
    out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(open(out / f"node{n}.log", "w")) for n in range(nodes)]
        launched = [
            subprocess.Popen(command, env={**base, "NODE_RANK": str(n)}, stdout=log, stderr=subprocess.STDOUT, cwd=out)
            for n, log in enumerate(logs)
        ]
        ended: dict[int, tuple[int, float]] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(ended) < nodes and time.monotonic() < deadline:
                for n, node in enumerate(launched):
                    if n not in ended and node.poll() is not None:
                        ended[n] = (node.returncode, time.monotonic())
                time.sleep(0.1)
        finally:
            for node in launched:
                if node.poll() is None:
                    node.kill()
                    node.wait()
    return [ended.get(n, (launched[n].returncode, time.monotonic())) for n in range(nodes)]


def assert_loss_fell(losses: list[float]) -> None:
    """The last three losses well below the first three: with weights that never change (DeepSpeed #6926's flat
    loss), batch-to-batch noise alone brought them to 0.98 of the first three in test_hpz_combinations.py."""
    assert sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory, request) -> Path:
    return tmp_path_factory.mktemp(request.module.__name__.split(".")[-1])


QUICKSTART_STEPS = 40


@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The README's first command cut to 40 steps (4 ranks, hpZ 2), exporting at the end: one launch that the
    quickstart and the Hugging Face export tests both read. Returns the run's directory and its output."""
    root = tmp_path_factory.mktemp("quickstart")
    command = [sys.executable, "-m", "lightning_hpz.cli", "fit", "--config", str(CONFIGS / "quickstart.yaml")]
    command += [f"--trainer.max_steps={QUICKSTART_STEPS}", "--trainer.val_check_interval=20"]
    command += ["--model.init_args.export_dir", "run/at_end"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    completed = subprocess.run(
        command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600
    )
    assert completed.returncode == 0, completed.stdout[-4000:]
    return root, completed


PLAIN_ZERO3_STEPS = 24
PLAIN_ZERO3_CHECKPOINT_EVERY = 11


@pytest.fixture(scope="session")
def plain_zero3_toy(tmp_path_factory) -> tuple[ScriptRun, Path]:
    """toy_training.py under plain ZeRO-3 (hpZ off) on 4 ranks, parameters re-gathered, a checkpoint at step 11: the
    ground truth the hpZ runs of test_strategy_training.py and test_race_emulation.py must equal. One launch for both;
    returns the run and its output directory (checkpoints under ``ckpt``)."""
    out = tmp_path_factory.mktemp("plain_zero3") / "hpz1"
    strategy = {"stage": 3, "hpz_partition_size": 1, "config": REGATHER_EVERY_MODULE}
    options = {"steps": PLAIN_ZERO3_STEPS, "strategy": strategy, "checkpoint_every": PLAIN_ZERO3_CHECKPOINT_EVERY}
    run = run_script("toy_training.py", options, out, ranks=4)
    assert_succeeded(run)
    return run, out


def netns_marks() -> list:
    """Marks of a test module that builds the two-node network-namespace testbed (skipped where it cannot)."""
    from lightning_hpz.bench.testbed import unavailable_reason

    reason = unavailable_reason()
    return [
        pytest.mark.netns,
        pytest.mark.multiprocess,
        pytest.mark.slow,
        pytest.mark.skipif(reason is not None, reason=f"two-node testbed unavailable: {reason}"),
    ]


# `make test` runs two files at a time (pytest-xdist, `--dist loadfile --no-loadscope-reorder`: files start in the
# order below, not xdist's default of most tests first). The longest files, longest first (wall seconds of the file
# run alone, on 2 cores shared with other work, 2026-12-07), so that none starts late and runs alone at the end; the
# others follow, launching ones first.
LONGEST_FILES = [
    "test_checkpoint_trust.py",  # 100 s
    "test_conversion_resume.py",  # 100 s where CI is set: a 3-node job losing a rank mid-conversion (slow), 64 s
    "test_strategy_training.py",  # 80-90 s, with test_race_emulation.py (SHARES_LAUNCH_OF)
    "test_gpu_evidence.py",  # 85 s: benchmarks/gpu_evidence.py --tiny starts a cold process per part
    "test_resume_by_name_runs.py",  # 78 s
    "test_hpz_three_nodes.py",  # 75 s: two 3-node jobs started as a user starts them
    "test_peer_loss_netns.py",  # 74 s, mostly waiting out timeouts
    "test_autotune_netns.py",  # 73 s
    "test_rank_failure.py",  # 70 s: Lightning's launcher and a peer's grace period, by design
    "test_hpz_combinations.py",  # 66 s
    "test_killed_saves.py",  # 60 s: eleven launches of a job killed whole
    "test_quickstart.py",  # 65 s, with test_hf_export.py
    "test_bench_netns.py",  # 62 s
    "test_preemption.py",  # 60 s
    "test_models_training.py",  # 56 s
    "test_callbacks_multiprocess.py",  # 56 s
]

# Files that read a session-scoped launch of another file run on that file's worker, so the launch happens once.
SHARES_LAUNCH_OF = {"test_hf_export.py": "test_quickstart.py", "test_race_emulation.py": "test_strategy_training.py"}


def pytest_collection_modifyitems(config, items) -> None:
    """LONGEST_FILES first, then the other files that launch processes, then the rest; a file sharing another's
    launch right after that file. A stable sort by file: a module's tests stay together and in order."""
    order = {name: i for i, name in enumerate(LONGEST_FILES)}

    def lead(item) -> str:
        return SHARES_LAUNCH_OF.get(item.path.name, item.path.name)

    launching = {lead(item) for item in items if item.get_closest_marker("multiprocess")}
    items.sort(key=lambda item: (order.get(lead(item), len(order)), lead(item) not in launching, lead(item)))


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile``, with the files of SHARES_LAUNCH_OF scheduled as one unit with the file they share with."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedLaunchScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            name = path.rpartition("/")[2]
            return path[: len(path) - len(name)] + SHARES_LAUNCH_OF.get(name, name)

    return SharedLaunchScheduling(config, log)
