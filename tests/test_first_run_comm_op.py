"""DeepSpeed's CPU communication op: a stale build lock never hangs a run; the build's own decisions, unit by unit."""

import os
import shutil
import subprocess
import sys
import time

import pytest
from conftest import assert_succeeded, run_script

from lightning_hpz.partitioning import cpu_comm_op, extension_build

OP = cpu_comm_op.OP_NAME


def _old_lock(directory):
    lock = directory / "lock"
    lock.touch()
    an_hour_ago = time.time() - 3600
    os.utime(lock, (an_hour_ago, an_hour_ago))
    return lock


def test_fresh_lock_is_not_stale(tmp_path):
    (tmp_path / "lock").touch()
    assert not extension_build.lock_is_stale(tmp_path / "lock")


def test_old_lock_with_nobody_in_the_build_directory_is_stale(tmp_path):
    assert extension_build.lock_is_stale(_old_lock(tmp_path))


def test_old_lock_with_a_process_in_the_build_directory_is_not_stale(tmp_path):
    lock = _old_lock(tmp_path)
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=tmp_path)  # a "compiler"
    try:
        time.sleep(0.5)
        assert worker.pid in extension_build.processes_working_in(tmp_path)
        assert not extension_build.lock_is_stale(lock)
    finally:
        worker.kill()
        worker.wait()


def test_missing_compiler_is_named(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    assert "'no-such-compiler-xyz'" in extension_build.missing_build_tools()


@pytest.fixture(scope="module")
def extensions_with_stale_lock(tmp_path_factory):
    """A private TORCH_EXTENSIONS_DIR holding a copy of the built op and a lock left by a killed build."""
    cpu_comm_op.prepare_cpu_comm_op()  # in the real cache, where every other multi-process test needs it anyway
    built = extension_build.build_directory(OP)
    extensions = tmp_path_factory.mktemp("torch_extensions")
    shutil.copytree(built, extensions / OP, symlinks=True, ignore=shutil.ignore_patterns("lock", "*.flock"))
    _old_lock(extensions / OP)
    return extensions


@pytest.mark.multiprocess
def test_stale_lock_does_not_hang_a_run(extensions_with_stale_lock, tmp_path):
    lock = extensions_with_stale_lock / OP / "lock"
    env = {"TORCH_EXTENSIONS_DIR": str(extensions_with_stale_lock)}
    options = {"devices": 2, "steps": 2, "strategy": {"stage": 3, "hpz_partition_size": 2}}
    run = run_script("toy_training.py", options, tmp_path / "out", timeout=300, env=env)  # hung forever before
    assert_succeeded(run, ranks=2)
    assert f"removed the stale build lock {lock}" in run.output
    assert not lock.exists()


def test_without_a_compiler_deepspeed_falls_back_to_gloo(tmp_path):
    # a fresh extensions dir (nothing built) and no compiler: the op is switched off, and DeepSpeed then skips it
    code = (
        "from lightning_hpz.partitioning import prepare_cpu_comm_op\n"
        "from deepspeed.comm.torch import build_shm_op\n"
        "print(prepare_cpu_comm_op(), build_shm_op())"
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": "no-such-compiler-xyz", "DS_ACCELERATOR": "cpu"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "'no-such-compiler-xyz' not found" in result.stdout and "apt-get install g++" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "disabled None"
    assert not (tmp_path / OP / f"{OP}.so").exists()
