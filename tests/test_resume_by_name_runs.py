"""Resumes by name on real processes (2 CPU ranks): ``ckpt_path="hpc"``, ``"last"`` and SLURM's auto-resume take the
newest committed checkpoint of the run, whatever its name, with preemption checkpoints retired as they are superseded;
and ``ckpt_path="last"`` (or the explicit path of ``last.ckpt``) after a commit killed between its two renames resumes
the newest committed step."""

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SCRIPTS, assert_succeeded, run_script
from warm_launcher import free_port

from lightning_hpz.checkpointing.staging import replaced_path, staging_path

pytestmark = pytest.mark.multiprocess

# job 0 saves hpc_ckpt_1 at step 2 and last.ckpt at 2 and 4; each later job resumes by name, and where Lightning's
# choice by name differs the expected start says what Lightning would have taken
JOBS = [
    {"max_steps": 4, "preempt_at": [2]},
    {"max_steps": 7, "ckpt_path": "hpc", "preempt_at": [7]},  # Lightning: hpc_ckpt_1 (step 2); last.ckpt is at 4
    {"max_steps": 9, "ckpt_path": "last", "preempt_at": [9]},  # Lightning: last.ckpt (step 6); hpc_ckpt_2 is at 7
    {"max_steps": 10, "ckpt_path": "hpc"},  # hpc_ckpt_3 at 9 against last.ckpt at 8: both agree
]


def _checkpoints(names: list[str]) -> list[str]:
    return [name for name in names if name.endswith(".ckpt")]


@pytest.fixture(scope="module")
def resumed(module_tmp: Path) -> tuple:
    root = module_tmp / "run"
    run = run_script("resume_by_name.py", {"root": str(root), "jobs": JOBS}, module_tmp / "jobs", timeout=500, ranks=2)
    assert_succeeded(run, ranks=2)
    return run, root


def test_hpc_and_last_resume_the_newest_committed_checkpoint(resumed):
    run, root = resumed
    for rank, record in run.ranks.items():
        jobs = record["jobs"]
        assert [job["start_step"] for job in jobs] == [0, 4, 7, 9], rank
        assert [job["end_step"] for job in jobs] == [4, 7, 9, 10], rank
        assert jobs[1]["resumed"] == str(root / "checkpoints" / "last.ckpt")
        assert jobs[2]["resumed"] == str(root / "hpc_ckpt_2.ckpt")
        assert jobs[3]["resumed"] == str(root / "hpc_ckpt_3.ckpt")


def test_preemption_checkpoints_are_retired_as_newer_ones_commit(resumed):
    run, _ = resumed
    folders = [job["folders"] for job in run.ranks[0]["jobs"]]
    assert _checkpoints(folders[0]["."]) == ["hpc_ckpt_1.ckpt"]
    assert _checkpoints(folders[1]["."]) == ["hpc_ckpt_2.ckpt", "preempted-step=2.ckpt"]
    # keep=1 (PreemptionCheckpoint's default): the older retired one is deleted
    assert _checkpoints(folders[2]["."]) == ["hpc_ckpt_3.ckpt", "preempted-step=7.ckpt"]
    assert _checkpoints(folders[3]["checkpoints"]) == ["last.ckpt"]


def test_slurm_auto_resume_takes_a_last_ckpt_newer_than_the_preemption_checkpoint(resumed, module_tmp):
    """Two tasks started as srun starts them, no ckpt_path: Lightning alone would resume hpc_ckpt_3 (step 9)."""
    _, root = resumed
    out = module_tmp / "slurm"
    options = json.dumps({"out": str(out), "root": str(root), "jobs": [{"max_steps": 11}]})
    common = {
        **os.environ, "PYTHONUNBUFFERED": "1", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1",
        "SLURM_NODEID": "0", "SLURM_JOB_ID": "4343", "SLURM_JOB_NAME": "hpz-resume-test",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
    }  # fmt: skip
    out.mkdir(parents=True)
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(open(out / f"task{rank}.log", "w")) for rank in range(2)]
        tasks = [
            subprocess.Popen(
                [sys.executable, str(SCRIPTS / "resume_by_name.py"), options],
                env={**common, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            for rank, log in enumerate(logs)
        ]
        codes = [task.wait(timeout=400) for task in tasks]
    output = (out / "task0.log").read_text()
    assert codes == [0, 0], output[-3000:]
    for rank in range(2):
        (job,) = json.loads((out / f"rank{rank}.json").read_text())["jobs"]
        assert job["start_step"] == 10 and job["resumed"] == str(root / "checkpoints" / "last.ckpt"), (rank, job)
    assert "Lightning's choice by name was" in output and "hpc_ckpt_3.ckpt (step 9)" in output


def test_last_or_its_path_after_a_commit_killed_between_its_two_renames(module_tmp):
    root, last = module_tmp / "fault", module_tmp / "fault" / "checkpoints" / "last.ckpt"
    killed = {"max_steps": 6, "fault_point": "commit:old_moved_aside", "fault_step": 4}
    run = run_script("resume_by_name.py", {"root": str(root), "renames": True, "jobs": [killed]}, module_tmp / "kill",
                     timeout=300, ranks=2)  # fmt: skip
    assert run.returncode != 0
    assert not last.exists() and replaced_path(last).is_dir(), run.output[-3000:]  # between the two renames
    # the same state, with the staged copy damaged: the repair must roll back instead
    rolled_back = module_tmp / "fault-damaged"
    shutil.copytree(root, rolled_back)
    shard = next((staging_path(rolled_back / "checkpoints" / "last.ckpt") / "checkpoint").glob("*optim_states.pt"))
    os.truncate(shard, shard.stat().st_size // 2)
    # "last" on torchrun-style ranks; the explicit path on Lightning's own launcher (rank 0 starts rank 1 inside the
    # entry point): both repair before they load
    for folder, step, ranks in ((root, 4, 2), (rolled_back, 2, None)):
        named = "last" if folder == root else str(folder / "checkpoints" / "last.ckpt")
        job = {"max_steps": 6, "ckpt_path": named}
        options = {"root": str(folder), "renames": True, "jobs": [job]}
        out = module_tmp / f"resume-{folder.name}"
        run = run_script("resume_by_name.py", options, out, timeout=300, ranks=ranks)
        assert_succeeded(run, ranks=2)
        for rank, record in run.ranks.items():
            (resumed,) = record["jobs"]
            assert resumed["start_step"] == step, (folder.name, rank, run.output[-3000:])
            assert resumed["resumed"] == str(folder / "checkpoints" / "last.ckpt")
