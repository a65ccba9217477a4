"""DeepSpeed's cpu_adam op (offloaded optimizer): built once before the ranks start, and a stale lock never hangs."""

import os
import shutil
import subprocess
import sys
import time

import lightning as L
import pytest

import lightning_hpz  # noqa: F401 - registers the strategy names
from lightning_hpz import partitioning
from lightning_hpz.lifecycle.op_build_launcher import OpsBuiltFirstLauncher
from lightning_hpz.partitioning import cpu_adam_op, extension_build

OP = cpu_adam_op.OP_NAME


def _stale_lock(directory):
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / "lock"
    lock.touch()
    an_hour_ago = time.time() - 3600
    os.utime(lock, (an_hour_ago, an_hour_ago))
    return lock


@pytest.mark.parametrize(
    ("config", "offloads"),
    [
        ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, True),
        ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}, True),
        ({"zero_optimization": {"offload_optimizer": {"device": "none"}}}, False),
        ({"zero_optimization": {"stage": 3}}, False),
        ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}, "zero_force_ds_cpu_optimizer": False}, False),
    ],
)
def test_which_configs_step_with_cpu_adam(config, offloads):
    assert cpu_adam_op.offloads_to_cpu_adam(config) is offloads


def test_offload_preset_builds_both_ops_before_the_ranks_start(monkeypatch):
    prepared = []
    monkeypatch.setattr(partitioning, "prepare_cpu_comm_op", lambda: prepared.append("comm"), raising=False)
    monkeypatch.setattr(partitioning, "prepare_cpu_adam_op", lambda: prepared.append(OP), raising=False)
    trainer = L.Trainer(strategy="hpz_offload", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy._launcher, OpsBuiltFirstLauncher)
    trainer.strategy._launcher.prepare_ops()
    assert prepared == ["comm", OP]


def test_without_offload_cpu_adam_is_left_alone(monkeypatch):
    prepared = []
    monkeypatch.setattr(partitioning, "prepare_cpu_comm_op", lambda: prepared.append("comm"), raising=False)
    monkeypatch.setattr(partitioning, "prepare_cpu_adam_op", lambda: prepared.append(OP), raising=False)
    L.Trainer(strategy="hpz", accelerator="cpu", devices=2, logger=False).strategy.prepare_deepspeed_ops()
    assert prepared == ["comm"]


def test_stale_lock_is_removed_before_cpu_adam_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = _stale_lock(tmp_path / OP)
    (tmp_path / OP / f"{OP}.so").touch()  # built earlier; the lock is what a killed rebuild left
    loads = []
    monkeypatch.setattr(cpu_adam_op, "_load", lambda: loads.append(lock.exists()))  # DeepSpeed would wait on it
    messages = []
    assert cpu_adam_op.prepare_cpu_adam_op(announce=messages.append) == "loaded"
    assert loads == [False]
    assert any(f"removed the stale build lock {lock}" in message for message in messages)


def test_without_a_compiler_an_offloaded_optimizer_stops_with_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    monkeypatch.setattr(cpu_adam_op, "_load", lambda: pytest.fail("tried to build without a compiler"))
    with pytest.raises(cpu_adam_op.CpuAdamBuildError, match=r"'no-such-compiler-xyz' not found.*apt-get install g\+\+"):
        cpu_adam_op.prepare_cpu_adam_op(announce=print)


@pytest.fixture
def extensions_with_stale_cpu_adam_lock(tmp_path):
    """A private TORCH_EXTENSIONS_DIR holding a copy of the built op and a lock left by a killed build."""
    cpu_adam_op.prepare_cpu_adam_op()  # in the real cache (builds it the first time: minutes)
    built = extension_build.build_directory(OP)
    extensions = tmp_path / "torch_extensions"
    shutil.copytree(built, extensions / OP, symlinks=True, ignore=shutil.ignore_patterns("lock", "*.flock"))
    _stale_lock(extensions / OP)
    return extensions


@pytest.mark.slow
def test_deepspeed_cpu_adam_loads_past_a_stale_lock(extensions_with_stale_cpu_adam_lock):
    # DeepSpeed's own DeepSpeedCPUAdam, in a fresh process: without the protection torch waits on that lock forever
    code = (
        "import torch\n"
        "from lightning_hpz.partitioning import prepare_cpu_adam_op\n"
        "print(prepare_cpu_adam_op())\n"
        "from deepspeed.ops.adam import DeepSpeedCPUAdam\n"
        "print(type(DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(4))])).__name__)"
    )
    lock = extensions_with_stale_cpu_adam_lock / OP / "lock"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions_with_stale_cpu_adam_lock), "DS_ACCELERATOR": "cpu"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"removed the stale build lock {lock}" in result.stdout
    assert result.stdout.strip().splitlines()[-2:] == ["loaded", "DeepSpeedCPUAdam"]
    assert not lock.exists()
