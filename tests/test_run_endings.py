"""How a run ends, on one process: its summary says what happened and lands in the run's own directory; a fit that
trains nothing exits non-zero; `lightning-hpz fit` keeps Lightning's guard against two runs writing one config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_hpz.cli.trained_steps import StepAtTrainStart, refuse_run_that_trained_nothing
from lightning_hpz.lifecycle.run_exit import NOTHING_TRAINED_EXIT_CODE
from lightning_hpz.models import TrainingSummary


class FailingModel(BoringModel):
    def training_step(self, batch, batch_idx):
        if self.global_step == 2:
            raise RuntimeError("a user's bug at step 2")
        return super().training_step(batch, batch_idx)


def _trainer(root: Path, callbacks: list, **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        default_root_dir=root,
        logger=CSVLogger(root, name="logs"),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **kwargs,
    )


def test_each_run_keeps_its_own_summary_and_the_link_points_at_the_newest(tmp_path):
    link = tmp_path / "summary.json"
    for steps in (3, 5):
        summary = TrainingSummary(summary_file=str(link))
        _trainer(tmp_path, [summary], max_steps=steps).fit(BoringModel())
    first = json.loads((tmp_path / "logs/version_0/summary.json").read_text())
    second = json.loads((tmp_path / "logs/version_1/summary.json").read_text())
    assert (first["status"], first["steps"], second["steps"]) == ("completed", 3, 5)
    assert link.is_symlink() and json.loads(link.read_text()) == second


def test_a_failed_run_writes_its_summary_with_the_reason(tmp_path, capsys):
    summary = TrainingSummary()
    with pytest.raises(RuntimeError, match="step 2"):
        _trainer(tmp_path, [summary], max_steps=10).fit(FailingModel())
    written = json.loads((tmp_path / "logs/version_0/summary.json").read_text())
    assert (written["status"], written["global_step"], written["steps"]) == ("failed", 2, 2)
    assert "a user's bug at step 2" in written["reason"]
    assert "ended early     a user's bug at step 2" in capsys.readouterr().out


def test_a_fit_that_trained_nothing_exits_non_zero_with_the_numbers(tmp_path, capsys):
    too_small = DataLoader(RandomDataset(32, 5), batch_size=8, drop_last=True)  # 5 samples, batches of 8
    trainer = _trainer(tmp_path, [], max_steps=10)
    trainer.fit(BoringModel(), too_small)
    with pytest.raises(SystemExit) as ended:
        refuse_run_that_trained_nothing(trainer)
    assert ended.value.code == NOTHING_TRAINED_EXIT_CODE
    assert "Nothing was trained: fit ended after 0 optimizer steps (max_steps=10, 0 training batches" in (
        capsys.readouterr().err
    )


def test_a_resumed_fit_that_trained_nothing_exits_4(tmp_path, capsys):
    first = _trainer(tmp_path, [], max_steps=2)
    first.fit(BoringModel())
    first.save_checkpoint(tmp_path / "at_end.ckpt")
    start = StepAtTrainStart()
    resumed = _trainer(tmp_path, [start], max_steps=2)
    resumed.fit(BoringModel(), ckpt_path=tmp_path / "at_end.ckpt")
    assert resumed.global_step == 2  # the interrupted run's steps: global_step alone cannot tell
    with pytest.raises(SystemExit) as ended:
        refuse_run_that_trained_nothing(resumed, start)
    assert ended.value.code == NOTHING_TRAINED_EXIT_CODE
    assert "the run resumed at step 2 and fit ended there (max_steps=2" in capsys.readouterr().err
    # one more step asked for: trained, left alone
    start = StepAtTrainStart()
    further = _trainer(tmp_path, [start], max_steps=3)
    further.fit(BoringModel(), ckpt_path=tmp_path / "at_end.ckpt")
    refuse_run_that_trained_nothing(further, start)  # no SystemExit
    assert start.step == 2 and further.global_step == 3


def test_a_fit_that_trained_is_left_alone(tmp_path):
    trainer = _trainer(tmp_path, [], max_steps=2)
    trainer.fit(BoringModel())
    refuse_run_that_trained_nothing(trainer)  # no SystemExit
    assert trainer.global_step == 2


def _cli_fit(root: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "lightning_hpz.cli", "fit", "--seed_everything", "0"]
    command += ["--trainer.accelerator", "cpu", "--trainer.max_steps", "2", "--trainer.default_root_dir", str(root)]
    command += ["--trainer.enable_progress_bar", "false", *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path.cwd()), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=root)


def test_cli_runs_of_one_config_get_their_own_directories_and_the_overwrite_guard_stays(tmp_path):
    boring = "lightning.pytorch.demos.boring_classes.BoringModel"
    runs = [_cli_fit(tmp_path, "--model", boring) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr[-3000:]
    configs = sorted(p.parent.name for p in tmp_path.glob("lightning_logs/*/config.yaml"))
    assert configs == ["version_0", "version_1"]
    # A run forced into the first one's log directory: Lightning's guard refuses it instead of overwriting.
    pinned = ["--model", boring, "--trainer.logger", "CSVLogger", "--trainer.logger.save_dir", str(tmp_path)]
    pinned += ["--trainer.logger.name", "lightning_logs", "--trainer.logger.version", "0"]
    second = _cli_fit(tmp_path, *pinned)
    assert second.returncode != 0 and "to avoid overwriting" in second.stderr, second.stderr[-2000:]


def test_tokens_are_counted_only_for_batches_that_name_their_tokens(tmp_path):
    summary = TrainingSummary()
    trainer = _trainer(tmp_path, [summary], max_steps=2)
    trainer.fit(BoringModel())
    assert summary.tokens == 0 and summary.losses and all(torch.isfinite(torch.tensor(summary.losses)))
