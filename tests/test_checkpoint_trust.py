"""Checkpoints you can trust and move, on real DeepSpeed over gloo with a plain MLP (not one of the package's models).

Three launches share the work: 4 ranks write ZeRO-1 and ZeRO-2 checkpoints, then (ZeRO-3, hpZ 2) checkpoints at
steps 2 and 4, and rank 1 is killed while writing its optimizer shard at step 6; 2 ranks then meet damaged copies
(each refused, the same way on every rank), resume ``ckpt_path="last"`` and the ZeRO-1 and ZeRO-2 checkpoints from 4
ranks, and write ZeRO-1 and ZeRO-2 checkpoints; 4 ranks resume those 2-rank checkpoints. Weights resumed on the new
world size are compared with the consolidated checkpoint, bit for bit, and Adam's moments with those saved.
"""

import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_read_in_parts, run_script, universal_state_bytes

from lightning_hpz.checkpointing import read_manifest
from lightning_hpz.checkpointing.consolidate import consolidate
from lightning_hpz.checkpointing.manifest import MANIFEST_NAME, file_digest

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
# fp32 weights and Adam's two moments of TwoGroupRegressor's 6,337 weights (32 x 64 + 64 + 64 x 64 + 64 + 64 + 1)
STATE_BYTES = 3 * 4 * 6337
TRAIN_START_MARKER = "/hpz-trace-marker-train-start"  # statted by checkpoint_training.py once the load is over

DAMAGED_FILES = {
    "model_states": "checkpoint/zero_pp_rank_0_mp_rank_00_model_states.pt",
    "optimizer_shard": "checkpoint/zero_pp_rank_1_mp_rank_00_optim_states.pt",
    "truncated_shard": "checkpoint/zero_pp_rank_2_mp_rank_00_optim_states.pt",
}
REFUSED_JOBS = ["model_states", "optimizer_shard", "truncated_shard", "stage_change"]
# TwoGroupRegressor's groups (tests/scripts/checkpoint_training.py), as JSON records them
GROUPS = [
    {"lr": 3e-3, "weight_decay": 0.1, "betas": [0.9, 0.999]},
    {"lr": 1e-3, "weight_decay": 0.0, "betas": [0.8, 0.99]},
]


@pytest.fixture(scope="module")
def written(module_tmp):
    """4 ranks write checkpoints at steps 2 and 4; rank 1 dies half-way through its shard at step 6."""
    job = {"stage": 3, "hpz": 2, "max_steps": 8, "kill_rank": 1, "kill_step": 6, "moments": True}
    # first, ZeRO-1 and ZeRO-2 checkpoints on 4 ranks for the 2-rank resizes (the killed job must come last)
    writers = [
        {"stage": k, "max_steps": 4, "ckpt_dir": str(module_tmp / f"ckpts4_stage{k}"), "moments": True} for k in (1, 2)
    ]
    options = {"devices": 4, "ckpt_dir": str(module_tmp / "ckpts"), "jobs": [*writers, job]}
    run = run_script("checkpoint_training.py", options, module_tmp / "write", timeout=400, ranks=4)
    ckpts = module_tmp / "ckpts"
    # what a restarted job finds, before the later launches write into the same directory
    after_crash = {
        "entries": sorted(os.listdir(ckpts)),
        "last_step": read_manifest(ckpts / "last.ckpt")["run"]["global_step"],
    }
    return run, ckpts, after_crash


def _damaged_copies(ckpts: Path, root: Path) -> dict[str, Path]:
    """Per case, a directory holding an intact step-2 checkpoint and a step-4 one damaged as the case says."""
    copies = {}
    for case in [*REFUSED_JOBS, "no_manifest"]:
        for step in (2, 4):
            shutil.copytree(ckpts / f"step={step}.ckpt", root / case / f"step={step}.ckpt")
        copies[case] = root / case / "step=4.ckpt"
    _flip_bit(copies["model_states"] / DAMAGED_FILES["model_states"])
    _flip_bit(copies["optimizer_shard"] / DAMAGED_FILES["optimizer_shard"])
    shard = copies["truncated_shard"] / DAMAGED_FILES["truncated_shard"]
    os.truncate(shard, shard.stat().st_size // 2)
    (copies["no_manifest"] / "hpz_manifest.json").unlink()
    return copies


def _flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def moved_down(written, module_tmp):
    """2 ranks: refuse four damaged or mismatched copies, load an old one, resume "last", write ZeRO-2 checkpoints."""
    run, ckpts, _ = written
    assert run.returncode != 0, "rank 1 was meant to die mid-save"
    copies = _damaged_copies(ckpts, module_tmp / "damaged")
    jobs = [{"stage": 3, "max_steps": 6, "ckpt_path": str(copies[case])} for case in REFUSED_JOBS]
    jobs[-1]["stage"] = 2
    # its own directory: its saves must not become the "last" checkpoint the next job resumes
    scratch = str(module_tmp / "ckpts_scratch")
    # 4 -> 2 ranks: exact in weights and optimizer state, not in data order, so only with exact_resume=False
    resize = {"stage": 3, "exact_resume": False}
    jobs.append({**resize, "max_steps": 5, "ckpt_path": str(copies["no_manifest"]), "ckpt_dir": scratch})
    jobs.append({**resize, "max_steps": 8, "ckpt_path": "last", "moments": True})
    jobs.append({"stage": 2, "max_steps": 4, "ckpt_dir": str(module_tmp / "ckpts_stage2"), "moments": True})
    jobs.append({"stage": 1, "max_steps": 4, "ckpt_dir": str(module_tmp / "ckpts_stage1"), "moments": True})
    for stage in (1, 2):  # 4 -> 2 ranks under ZeRO-1 and ZeRO-2 (jobs 8 and 9)
        source = str(module_tmp / f"ckpts4_stage{stage}" / "step=4.ckpt")
        jobs.append(
            {**resize, "stage": stage, "max_steps": 6, "ckpt_path": source, "ckpt_dir": scratch, "moments": True}
        )
    # job 10: a 2-rank checkpoint (job 5's) resumed on 2 ranks, for what each rank is dealt of its manifest
    same = str(module_tmp / "ckpts_same2")
    jobs.append({"stage": 3, "max_steps": 7, "ckpt_path": str(ckpts / "step=6.ckpt"), "ckpt_dir": same})
    jobs.append({"stage": 3, "max_steps": 8, "ckpt_path": str(ckpts / "step=4.ckpt"), "ckpt_dir": scratch})
    options = {"devices": 2, "ckpt_dir": str(ckpts), "jobs": jobs}
    return run_script("checkpoint_training.py", options, module_tmp / "down", timeout=500, ranks=2), copies


@pytest.fixture(scope="module")
def moved_up(moved_down, written, module_tmp):
    """4 ranks resume the 2-rank checkpoints: ZeRO-2, ZeRO-3 with hpZ 2, ZeRO-1."""
    _, ckpts, _ = written
    jobs = [
        {"stage": 2, "max_steps": 6, "ckpt_path": str(module_tmp / "ckpts_stage2" / "step=4.ckpt"), "moments": True},
        {"stage": 3, "hpz": 2, "max_steps": 10, "ckpt_path": str(ckpts / "step=8.ckpt"), "moments": True},
        {"stage": 1, "max_steps": 6, "ckpt_path": str(module_tmp / "ckpts_stage1" / "step=4.ckpt"), "moments": True},
    ]
    for job in jobs:
        job["exact_resume"] = False  # a resize: see test_resize_under_exact_resume_is_refused
    # job 3: the 4-rank ZeRO-3 step-4 checkpoint resumed on 4 ranks and saved again at step 6, its file calls traced
    traced = {"stage": 3, "hpz": 2, "max_steps": 6, "ckpt_path": str(ckpts / "step=4.ckpt"), "trace_files": True}
    jobs.append({**traced, "ckpt_dir": str(module_tmp / "ckpts_traced")})
    options = {"devices": 4, "ckpt_dir": str(module_tmp / "ckpts_up"), "jobs": jobs}
    return run_script("checkpoint_training.py", options, module_tmp / "up", timeout=400, ranks=4)


def _jobs(run, ranks: int) -> list[list[dict]]:
    assert run.returncode == 0, run.output[-4000:]
    assert sorted(run.ranks) == list(range(ranks)), run.output[-4000:]
    return [run.ranks[rank]["jobs"] for rank in range(ranks)]


def test_rank_killed_mid_save_leaves_the_previous_checkpoint_resumable(written, moved_down):
    jobs = _jobs(moved_down[0], 2)
    resumed = [rank_jobs[5] for rank_jobs in jobs]
    # "last" pointed at the step-4 checkpoint, not at the half-written step-6 one
    assert [job["start_step"] for job in resumed] == [4, 4]
    assert [job["end_step"] for job in resumed] == [8, 8]


def test_killed_save_never_appears_at_its_path(written):
    run, ckpts, _ = written
    assert run.returncode != 0
    assert read_manifest(ckpts / "step=4.ckpt")["run"]["global_step"] == 4


@pytest.mark.parametrize("case", ["model_states", "optimizer_shard"])
def test_flipped_bit_refused_naming_the_file(moved_down, case):
    run, copies = moved_down
    index = REFUSED_JOBS.index(case)
    for rank_jobs in _jobs(run, 2):
        error = rank_jobs[index]
        assert error["error_type"] == "CheckpointIntegrityError"
        assert str(copies[case] / DAMAGED_FILES[case]) in error["error"]
        recorded = read_manifest(copies[case])["files"][DAMAGED_FILES[case]]["blake2b"]
        found = file_digest(copies[case] / DAMAGED_FILES[case])["blake2b"]
        assert f"with blake2b {recorded}, found" in error["error"] and f"with blake2b {found}" in error["error"]
        assert (
            f"last good checkpoint in {copies[case].parent} is {copies[case].parent / 'step=2.ckpt'}" in error["error"]
        )


def test_truncated_shard_reported_identically_on_all_ranks(moved_down):
    run, copies = moved_down
    errors = [rank_jobs[REFUSED_JOBS.index("truncated_shard")] for rank_jobs in _jobs(run, 2)]
    assert errors[0] == errors[1]
    shard = copies["truncated_shard"] / DAMAGED_FILES["truncated_shard"]
    recorded = read_manifest(copies["truncated_shard"])["files"][DAMAGED_FILES["truncated_shard"]]
    assert f"{shard}: expected {recorded['size']} bytes" in errors[0]["error"]
    assert f"found {shard.stat().st_size} bytes" in errors[0]["error"]


def test_stage_change_refused_naming_both_stages(moved_down):
    errors = [rank_jobs[REFUSED_JOBS.index("stage_change")] for rank_jobs in _jobs(moved_down[0], 2)]
    assert errors[0] == errors[1]
    assert errors[0]["error_type"] == "CheckpointMismatchError"
    assert "written with stage 3, this run uses stage 2" in errors[0]["error"]


def test_checkpoint_without_manifest_loads_with_one_warning(moved_down):
    jobs = _jobs(moved_down[0], 2)
    old = jobs[0][len(REFUSED_JOBS)]
    assert old["start_step"] == 4 and old["end_step"] == 5
    assert sum("no integrity manifest" in warning for warning in old["warnings"]) == 1


def _assert_weights_match(weights_file: Path, checkpoint_dir: Path, tmp: Path) -> None:
    resumed = torch.load(weights_file)
    consolidated = consolidate(checkpoint_dir, tmp / f"{checkpoint_dir.parent.name}-{checkpoint_dir.name}.pt")
    state = consolidated["state_dict"]
    assert sorted(resumed) == sorted(state)
    assert all(torch.equal(resumed[name], state[name]) for name in state), "weights changed in the move"


def _assert_moments_match(resumed: Path, saved: Path) -> None:
    """Adam's moments, whole, as the resized run starts against those of the run that saved: bit for bit."""
    before, after = torch.load(saved), torch.load(resumed)
    assert sorted(before) == sorted(after) and len(before) >= 2
    differing = [name for name in before if not torch.equal(before[name], after[name])]
    assert not differing, f"moments changed in the move: {differing}"
    assert any(value.abs().sum() > 0 for value in before.values())  # real moments, not zeros on both sides


def test_four_to_two_ranks_resumes_identical_weights_and_trains(written, moved_down, module_tmp):
    _, ckpts, _ = written
    jobs = _jobs(moved_down[0], 2)
    resumed_job = 5
    _assert_weights_match(module_tmp / "down" / f"weights_job{resumed_job}.pt", ckpts / "step=4.ckpt", module_tmp)
    losses = jobs[0][resumed_job]["losses"]
    assert sorted(int(step) for step in losses) == [4, 5, 6, 7]
    assert all(math.isfinite(loss) for loss in losses.values())
    assert any("written on 4 ranks on 2 ranks" in w and "data order" in w for w in jobs[0][resumed_job]["warnings"])
    # each parameter group keeps its own settings through the conversion (DeepSpeed's copied the first group's)
    assert all(rank_jobs[resumed_job]["groups"] == GROUPS for rank_jobs in jobs)
    # its copy went with the "last" checkpoint that later saves replaced: the state of the same model
    assert_read_in_parts([rank_jobs[resumed_job]["universal_reads"] for rank_jobs in jobs], STATE_BYTES)
    # ZeRO-3 + hpZ 2 on 4 ranks to ZeRO-3 on 2: the optimizer state is carried exactly, not only the weights
    _assert_moments_match(module_tmp / "down" / f"moments_job{resumed_job}_step4.pt", module_tmp / "write" /
                          "moments_job2_step4.pt")  # fmt: skip


@pytest.mark.parametrize("job,stage", [(8, 1), (9, 2)])
def test_four_to_two_ranks_under_zero_1_and_2_keeps_weights_groups_and_moments(moved_down, module_tmp, job, stage):
    jobs = _jobs(moved_down[0], 2)
    source = module_tmp / f"ckpts4_stage{stage}" / "step=4.ckpt"
    assert read_manifest(source)["run"]["world_size"] == 4
    _assert_weights_match(module_tmp / "down" / f"weights_job{job}.pt", source, module_tmp)
    assert [rank_jobs[job]["start_step"] for rank_jobs in jobs] == [4, 4]
    assert all(rank_jobs[job]["groups"] == GROUPS for rank_jobs in jobs)
    assert universal_state_bytes(source / "universal") == STATE_BYTES
    assert_read_in_parts([rank_jobs[job]["universal_reads"] for rank_jobs in jobs], STATE_BYTES)
    # written by the 4-rank launch's job 0 (ZeRO-1) or 1 (ZeRO-2) before its step-4 save
    _assert_moments_match(module_tmp / "down" / f"moments_job{job}_step4.pt", module_tmp / "write" /
                          f"moments_job{stage - 1}_step4.pt")  # fmt: skip
    assert all(math.isfinite(loss) for loss in jobs[0][job]["losses"].values())


@pytest.mark.parametrize("job,stage,steps", [(0, 2, [4, 5]), (1, 3, [8, 9]), (2, 1, [4, 5])])
def test_two_to_four_ranks_resumes_identical_weights_and_trains(moved_up, written, module_tmp, job, stage, steps):
    _, ckpts, _ = written
    source = ckpts / "step=8.ckpt" if stage == 3 else module_tmp / f"ckpts_stage{stage}" / "step=4.ckpt"
    assert read_manifest(source)["run"]["world_size"] == 2
    jobs = _jobs(moved_up, 4)
    _assert_weights_match(module_tmp / "up" / f"weights_job{job}.pt", source, module_tmp)
    assert [rank_jobs[job]["start_step"] for rank_jobs in jobs] == [steps[0]] * 4
    assert all(rank_jobs[job]["groups"] == GROUPS for rank_jobs in jobs)
    assert universal_state_bytes(source / "universal") == STATE_BYTES
    assert_read_in_parts([rank_jobs[job]["universal_reads"] for rank_jobs in jobs], STATE_BYTES)
    # saved by the 2-rank jobs that wrote the source (index 6: ZeRO-2 to step 4; 7: ZeRO-1 to 4; 5: ZeRO-3 to 8)
    writer = {2: "moments_job6_step4.pt", 1: "moments_job7_step4.pt", 3: "moments_job5_step8.pt"}[stage]
    saved = module_tmp / "down" / writer
    _assert_moments_match(module_tmp / "up" / f"moments_job{job}_step{steps[0]}.pt", saved)
    losses = jobs[0][job]["losses"]
    assert sorted(int(step) for step in losses) == steps
    assert all(math.isfinite(loss) for loss in losses.values())


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace (apt-get install strace)")
def test_ranks_touch_only_their_own_shards_when_saving_and_loading(moved_up, module_tmp):
    # at 1,024 ranks a save that lists or stats every rank's files costs N^2 metadata operations: each rank > 0 must
    # touch its own shards only (rank 0 assembles the manifest); loading, DeepSpeed's own existence checks of the
    # other ranks' optimizer shards (N-1, `_get_all_zero_checkpoint_names`) are all it may add
    jobs = _jobs(moved_up, 4)
    assert [(rank_jobs[3]["start_step"], rank_jobs[3]["end_step"]) for rank_jobs in jobs] == [(4, 6)] * 4
    existence_check = re.compile(r"\d+\s+(newfstatat|stat|lstat|statx|access|faccessat2?)\(")
    for rank in range(1, 4):
        lines = (module_tmp / "up" / f"strace_job3_rank{rank}.txt").read_text().splitlines()
        train_start = next(i for i, line in enumerate(lines) if TRAIN_START_MARKER in line)
        load, train = lines[:train_start], lines[train_start:]
        others = re.compile(rf"zero_pp_rank_(?!{rank}_)\d+_")
        assert [line for line in train if others.search(line)] == []
        checks = [line for line in load if others.search(line)]
        assert len(checks) <= 3 and all(existence_check.match(line) for line in checks), checks
        # rank 0 reads the manifest and sends each rank its entries: no rank > 0 opens or stats it
        assert [line for line in load if MANIFEST_NAME in line] == []
        own = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"  # read when loading, written when saving
        assert any(own in line and "openat" in line and "O_RDONLY" in line for line in load)
        assert any(own in line and "openat" in line and "O_WRONLY" in line for line in train)
    lines = (module_tmp / "up" / "strace_job3_rank0.txt").read_text().splitlines()
    load = lines[: next(i for i, line in enumerate(lines) if TRAIN_START_MARKER in line)]
    manifest = str(module_tmp / "ckpts" / "step=4.ckpt" / MANIFEST_NAME)
    assert len([line for line in load if manifest in line and "openat" in line]) == 1


def test_each_rank_is_sent_only_its_own_manifest_entries_at_two_and_four_ranks(moved_down, moved_up):
    # O(own files) per rank, whatever the number of ranks: its 2 shards and `latest`, never the whole manifest
    sent = {2: [rank_jobs[10]["dealt"] for rank_jobs in _jobs(moved_down[0], 2)]}
    sent[4] = [rank_jobs[3]["dealt"] for rank_jobs in _jobs(moved_up, 4)]
    for dealt in sent.values():
        for rank, (received,) in enumerate(dealt):  # one scatter per load
            shards = [f"checkpoint/zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt" for kind in ("model", "optim")]
            assert received["files"] == sorted([*shards, "latest"])
    assert len({received["bytes"] for dealt in sent.values() for (received,) in dealt}) == 1, sent


def test_resize_under_exact_resume_is_refused(moved_down):
    # exact_resume=True (the default) promises the interrupted run's batches, which another world size cannot give
    errors = [rank_jobs[-1] for rank_jobs in _jobs(moved_down[0], 2)]
    assert errors[0] == errors[1]
    assert errors[0]["error_type"] == "CheckpointMismatchError"
    assert "it was written on 4 ranks and this run has 2" in errors[0]["error"]
    assert "HpzStrategy(exact_resume=False)" in errors[0]["error"]


def test_convert_command_writes_the_copy_into_a_cache_folder(written, tmp_path):
    # ahead of a resize, for a checkpoint the run must not (or cannot) write into
    _, ckpts, _ = written
    command = [sys.executable, "-m", "lightning_hpz.cli", "checkpoint", "convert", str(ckpts / "step=2.ckpt")]
    command += ["--cache", str(tmp_path / "cache")]
    first = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "LIGHTNING_HPZ_UNIVERSAL_CACHE=" in first.stdout
    (copy,) = (tmp_path / "cache").iterdir()
    assert (copy / "latest").read_text() == "checkpoint" and (copy / "checkpoint" / "zero").is_dir()
    assert not (ckpts / "step=2.ckpt" / "universal").exists()  # the checkpoint itself is left as it was
    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "already converted" in again.stdout
