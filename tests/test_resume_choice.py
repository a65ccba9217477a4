"""A resume by name (``ckpt_path="hpc"``, ``"last"``, SLURM's auto-resume) takes the newest committed checkpoint of
the run by global step, whatever its name; ties keep Lightning's choice; an explicit path is Lightning's business.
The rule alone, then through the Trainer's connector as the strategy's launcher installs it (no process group: rank 0
decides, as in a run)."""

import os

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from lightning.pytorch.trainer.states import TrainerFn

from lightning_hpz import HpzStrategy
from lightning_hpz.checkpointing import manifest, resume_by_name
from lightning_hpz.checkpointing.commit import committed_save
from lightning_hpz.checkpointing.manifest import MANIFEST_NAME
from lightning_hpz.checkpointing.resume_choice import (
    CommittedCheckpoint,
    choose,
    choose_complete,
    committed_checkpoints,
)
from lightning_hpz.checkpointing.staging import replaced_path, staging_path

RUN = {"stage": 3, "world_size": 1, "hpz_partition_size": 1, "epoch": 0, "optimizer": "AdamW"}
SLURM = {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "77", "SLURM_PROCID": "0"}


def _commit(path, step):
    with committed_save(path, {**RUN, "global_step": step}) as staging:
        (staging / "checkpoint").mkdir(parents=True)
        torch.save({"w": torch.zeros(2)}, staging / "checkpoint" / "mp_rank_00_model_states.pt")
    return path


def _at(path, step, committed_at=0.0):
    return CommittedCheckpoint(path, step, committed_at)


def test_the_highest_step_wins_whatever_its_name(tmp_path):
    hpc, last = tmp_path / "hpc_ckpt_3.ckpt", tmp_path / "last.ckpt"
    assert choose(hpc, [_at(hpc, 10), _at(last, 20)]) == last
    assert choose(last, [_at(hpc, 30), _at(last, 20)]) == hpc


def test_a_tie_keeps_lightnings_choice_then_the_latest_commit(tmp_path):
    hpc, last, other = tmp_path / "hpc_ckpt_1.ckpt", tmp_path / "last.ckpt", tmp_path / "step=20.ckpt"
    assert choose(hpc, [_at(hpc, 20, committed_at=1.0), _at(last, 20, committed_at=2.0)]) == hpc
    assert choose(None, [_at(other, 20, committed_at=3.0), _at(last, 20, committed_at=2.0)]) == other
    assert choose(tmp_path / "gone.ckpt", [_at(other, 20, 1.0), _at(last, 20, 1.0)]) == other  # then by name


def test_nothing_committed_leaves_lightnings_choice(tmp_path):
    assert choose(tmp_path / "hpc_ckpt_1.ckpt", []) == tmp_path / "hpc_ckpt_1.ckpt"
    assert choose(None, []) is None


def test_only_complete_committed_checkpoints_compete(tmp_path, monkeypatch):
    _commit(tmp_path / "hpc_ckpt_1.ckpt", 10)
    damaged = _commit(tmp_path / "last.ckpt", 30)
    shard = damaged / "checkpoint" / "mp_rank_00_model_states.pt"
    os.truncate(shard, shard.stat().st_size // 2)
    (tmp_path / "plain.ckpt" / "checkpoint").mkdir(parents=True)  # no manifest: not written by this package
    staged = staging_path(tmp_path / "step=40.ckpt")  # never committed
    staged.parent.mkdir()
    _commit(tmp_path / "elsewhere" / "step=40.ckpt", 40).rename(staged)
    (tmp_path / "notes.ckpt").write_text("a file")
    found = committed_checkpoints([tmp_path, tmp_path / "missing"])
    assert [(c.path.name, c.step) for c in found] == [("hpc_ckpt_1.ckpt", 10), ("last.ckpt", 30)]  # manifests only
    statted = []
    monkeypatch.setattr(manifest, "verify_files", lambda folder, *args, **kwargs: statted.append(folder.name) or [])
    assert choose_complete(None, found) == tmp_path / "last.ckpt" and statted == ["last.ckpt"]  # the chosen alone
    monkeypatch.undo()
    assert choose_complete(None, found) == tmp_path / "hpc_ckpt_1.ckpt"  # the damaged newer one, statted, loses


def _trainer(root):
    return L.Trainer(
        strategy=HpzStrategy(), accelerator="cpu", devices=1, default_root_dir=root, logger=False,
        callbacks=[ModelCheckpoint(dirpath=root / "checkpoints", save_last=True)],
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip


def _resolve(trainer, ckpt_path, fn=TrainerFn.FITTING):
    """What the entry point resolves, then what the strategy chooses once the process group exists."""
    with resume_by_name.connector_installed(trainer):
        parsed = trainer._checkpoint_connector._select_ckpt_path(fn, ckpt_path, True, False)
        resume_by_name.choose(trainer)
        return resume_by_name.chosen_path(parsed)


@pytest.mark.parametrize("ckpt_path", ["hpc", "last"])
def test_hpc_and_last_take_the_newest_committed_of_the_runs_folders(tmp_path, ckpt_path):
    _commit(tmp_path / "hpc_ckpt_1.ckpt", 10)
    _commit(tmp_path / "hpc_ckpt_2.ckpt", 30)
    _commit(tmp_path / "checkpoints" / "last.ckpt", 20)
    _commit(tmp_path / "checkpoints" / "step=25.ckpt", 25)
    assert _resolve(_trainer(tmp_path), ckpt_path) == str(tmp_path / "hpc_ckpt_2.ckpt")
    _commit(tmp_path / "checkpoints" / "last.ckpt", 40)
    assert _resolve(_trainer(tmp_path), ckpt_path) == str(tmp_path / "checkpoints" / "last.ckpt")


def test_slurm_auto_resume_takes_the_newest_but_starts_only_where_lightning_would(tmp_path, monkeypatch):
    _commit(tmp_path / "checkpoints" / "last.ckpt", 20)
    trainer = _trainer(tmp_path)
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    assert _resolve(trainer, None) is None  # no hpc_ckpt_<N>: Lightning's auto-resume does not start
    _commit(tmp_path / "hpc_ckpt_1.ckpt", 10)
    assert _resolve(trainer, None) == str(tmp_path / "checkpoints" / "last.ckpt")
    monkeypatch.undo()
    assert _resolve(trainer, None) is None  # not under SLURM: no resume without ckpt_path


def test_last_repairs_a_commit_killed_between_its_two_renames_first(tmp_path):
    last = tmp_path / "checkpoints" / "last.ckpt"
    _commit(last, 20)
    staging_path(last).parent.mkdir(exist_ok=True)
    _commit(tmp_path / "elsewhere" / "last.ckpt", 30).rename(staging_path(last))  # complete staged copy
    last.rename(replaced_path(last))  # killed here: no last.ckpt
    assert _resolve(_trainer(tmp_path), "last") == str(last)
    assert (last / MANIFEST_NAME).is_file() and not replaced_path(last).exists()
    assert committed_checkpoints([last.parent])[0].step == 30  # rolled forward


def test_explicit_paths_and_missing_names_stay_lightnings(tmp_path):
    _commit(tmp_path / "checkpoints" / "last.ckpt", 20)
    old = _commit(tmp_path / "checkpoints" / "step=10.ckpt", 10)
    trainer = _trainer(tmp_path)
    assert _resolve(trainer, str(old)) == str(old)
    with pytest.raises(ValueError, match="no HPC checkpoint was found"):
        _resolve(trainer, "hpc")
    assert type(trainer._checkpoint_connector) is _CheckpointConnector  # swapped back after the entry point


def test_last_with_nothing_anywhere_warns_as_lightning_does(tmp_path):
    with pytest.warns(UserWarning, match="there is no last checkpoint available"):
        assert _resolve(_trainer(tmp_path), "last") is None
