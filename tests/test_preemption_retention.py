"""Preemption checkpoints older than a newer preemption checkpoint are retired (renamed out of auto-resume's sight,
which then finds the newest) and pruned."""

import torch

from lightning_hpz.checkpointing.commit import committed_save
from lightning_hpz.checkpointing.preemption_retention import retire_older_preemption_checkpoints

RUN = {"stage": 3, "world_size": 1, "hpz_partition_size": 1, "epoch": 0, "optimizer": "AdamW"}


def _commit(path, step):
    with committed_save(path, {**RUN, "global_step": step}) as staging:
        (staging / "checkpoint").mkdir(parents=True)
        torch.save({"w": torch.zeros(2)}, staging / "checkpoint" / "mp_rank_00_model_states.pt")


def test_older_preemption_checkpoints_are_retired_and_pruned(tmp_path):
    _commit(tmp_path / "hpc_ckpt_1.ckpt", 10)
    _commit(tmp_path / "hpc_ckpt_2.ckpt", 20)
    (tmp_path / "hpc_ckpt_3.ckpt").mkdir()  # not ours (no manifest): left alone
    _commit(tmp_path / "hpc_ckpt_4.ckpt", 30)
    done = retire_older_preemption_checkpoints(tmp_path, committed_step=30, keep=1)
    names = sorted(path.name for path in tmp_path.iterdir() if path.name != ".hpz-writer.json")
    # Lightning's auto-resume takes the largest hpc_ckpt_N: the newest, committed last
    assert names == ["hpc_ckpt_3.ckpt", "hpc_ckpt_4.ckpt", "preempted-step=20.ckpt"]
    assert done == [
        "hpc_ckpt_1.ckpt (step 10) -> preempted-step=10.ckpt",
        "hpc_ckpt_2.ckpt (step 20) -> preempted-step=20.ckpt",
        "deleted preempted-step=10.ckpt",
    ]


def test_a_preemption_checkpoint_newer_than_the_commit_stays(tmp_path):
    _commit(tmp_path / "hpc_ckpt_1.ckpt", 40)
    assert retire_older_preemption_checkpoints(tmp_path, committed_step=30) == []
    assert (tmp_path / "hpc_ckpt_1.ckpt").is_dir()
