"""A checkpoint commit killed (SIGKILL) at each of its steps never costs the checkpoint last reported committed.

Each case runs a process that commits ``last.ckpt`` at step 2, then again at step 4 with
``LIGHTNING_HPZ_FAULT_POINT`` set, so that it kills itself at that point of the second commit. Then, as the next start
or save does, the interrupted commit is repaired; ``last.ckpt`` must be a complete, verified checkpoint: step 2 when
the kill came before anything moved, step 4 once the staged copy was complete and verified (rolled forward), and a
third commit must succeed. Both commit paths: the atomic exchange of the new copy with the old one (Linux
``renameat2``), and the two renames used where the file system cannot exchange.
"""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lightning_hpz.checkpointing.commit import committed_save, wait_for_old_copy_deletion
from lightning_hpz.checkpointing.commit_repair import repair_interrupted_commit
from lightning_hpz.checkpointing.fault_points import COMMIT_POINTS, FAULT_POINT_ENV_VAR
from lightning_hpz.checkpointing.manifest import read_manifest, verify_files
from lightning_hpz.checkpointing.staging import replaced_path

RUN = {"stage": 3, "world_size": 1, "hpz_partition_size": 1, "epoch": 0, "optimizer": "AdamW"}

COMMIT_TWICE = textwrap.dedent(
    """
    import os, sys, torch
    from pathlib import Path
    from lightning_hpz.checkpointing import commit

    if sys.argv[2] == "renames":
        commit.atomic_exchange = lambda first, second: False  # a file system that cannot exchange
    final = Path(sys.argv[1])
    fault = os.environ.pop("LIGHTNING_HPZ_FAULT_POINT")
    for step in (2, 4):
        if step == 4:
            os.environ["LIGHTNING_HPZ_FAULT_POINT"] = fault
        run = {"stage": 3, "world_size": 1, "hpz_partition_size": 1, "epoch": 0, "optimizer": "AdamW",
               "global_step": step}
        with commit.committed_save(final, run) as staging:
            (staging / "checkpoint").mkdir(parents=True)
            torch.save({"w": torch.full((1024,), float(step))}, staging / "checkpoint" / "mp_rank_00_model_states.pt")
    """
)


def _committed_step(path: Path) -> int:
    recorded = read_manifest(path)
    assert recorded is not None, path
    assert verify_files(path, recorded, list(recorded["files"])) == []
    return recorded["run"]["global_step"]


@pytest.mark.parametrize("commit_path", ["exchange", "renames"])
@pytest.mark.parametrize("point", COMMIT_POINTS)
def test_a_commit_killed_at_any_point_keeps_a_complete_checkpoint(tmp_path, commit_path, point):
    final = tmp_path / "last.ckpt"
    env = {**os.environ, FAULT_POINT_ENV_VAR: point, "PYTHONPATH": str(Path(__file__).parents[1])}
    ended = subprocess.run([sys.executable, "-c", COMMIT_TWICE, str(final), commit_path], env=env, timeout=120)
    reached = commit_path == "renames" or point != "commit:old_moved_aside"  # an exchange moves nothing aside
    assert ended.returncode == (-signal.SIGKILL if reached else 0)
    repair_interrupted_commit(final)  # what the next save (or start) does first
    # nothing moved before the manifest point: the old copy stays; after it, the staged copy is complete and verifies
    assert _committed_step(final) == (2 if point == "commit:manifest_written" else 4)
    assert not replaced_path(final).exists()
    with committed_save(final, {**RUN, "global_step": 6}) as staging:
        (staging / "checkpoint").mkdir(parents=True)
        torch.save({"w": torch.zeros(4)}, staging / "checkpoint" / "mp_rank_00_model_states.pt")
    assert _committed_step(final) == 6


def test_the_two_rename_commit_rolls_back_when_the_staged_copy_is_incomplete(tmp_path):
    final = tmp_path / "last.ckpt"
    with committed_save(final, {**RUN, "global_step": 2}) as staging:
        (staging / "checkpoint").mkdir(parents=True)
        torch.save({"w": torch.ones(4)}, staging / "checkpoint" / "mp_rank_00_model_states.pt")
    # a crash with the old copy aside and a staged copy that never got its manifest
    (final.parent / ".hpz-staging" / "last.ckpt.partial").mkdir(parents=True)
    final.rename(replaced_path(final))
    assert repair_interrupted_commit(final).startswith("rolled back to the previous copy")
    assert _committed_step(final) == 2


def _interrupt_second_commit(final: Path) -> Path:
    """Commit steps 2 and 4, then put the folder in the state of a kill between the two renames of the second."""
    for step in (2, 4):
        with committed_save(final, {**RUN, "global_step": step}) as staging:
            (staging / "checkpoint").mkdir(parents=True)
            torch.save({"w": torch.full((1024,), float(step))}, staging / "checkpoint" / "mp_rank_00_model_states.pt")
        if step == 2:
            kept = final.parent / "step2.copy"
            shutil.copytree(final, kept)
    wait_for_old_copy_deletion()  # step 2's copy, replaced, is deleted in the background
    staged = final.parent / ".hpz-staging" / "last.ckpt.partial"
    staged.parent.mkdir(exist_ok=True)
    final.rename(staged)
    kept.rename(replaced_path(final))
    return staged / "checkpoint" / "mp_rank_00_model_states.pt"


def test_a_staged_copy_of_the_right_size_but_wrong_bytes_is_not_rolled_forward(tmp_path):
    # rolling forward deletes the old copy: a size check alone would have traded the good step 2 for a damaged step 4
    shard = _interrupt_second_commit(tmp_path / "last.ckpt")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert repair_interrupted_commit(tmp_path / "last.ckpt").startswith("rolled back")
    assert _committed_step(tmp_path / "last.ckpt") == 2


def test_a_staged_copy_that_verifies_is_rolled_forward(tmp_path):
    _interrupt_second_commit(tmp_path / "last.ckpt")
    assert repair_interrupted_commit(tmp_path / "last.ckpt").startswith("rolled forward")
    assert _committed_step(tmp_path / "last.ckpt") == 4
    assert not replaced_path(tmp_path / "last.ckpt").exists()
