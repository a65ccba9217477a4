"""From `lightning-hpz fit` on 2 CPU ranks to a directory that transformers' Auto classes load and generate with."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_hpz.data.tokenizers import ByteTokenizer
from lightning_hpz.hf_export import ExportError, export_checkpoint

QUICKSTART = str(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml")
TWO_STEPS = ["--trainer.devices", "2", "--trainer.max_steps", "2", "--trainer.val_check_interval", "2"]
TWO_STEPS += ["--trainer.limit_val_batches", "1", "--trainer.default_root_dir", "run"]


def _cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "lightning_hpz.cli", *argv]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=cwd, env=env)


@pytest.fixture(scope="module")
def trained(module_tmp):
    """A tiny Llama-2 trained with hpZ on 2 ranks; export_dir set, and a sharded checkpoint written at the end."""
    fit = _cli("fit", "--config", QUICKSTART, *TWO_STEPS, "--model.init_args.export_dir", "run/at_end", cwd=module_tmp)
    assert fit.returncode == 0, fit.stdout[-3000:] + fit.stderr[-3000:]
    summary = json.loads((module_tmp / "runs" / "quickstart" / "summary.json").read_text())
    checkpoint = module_tmp / summary["checkpoint"]
    exported = _cli("export", str(checkpoint), "exported", cwd=module_tmp)
    assert exported.returncode == 0, exported.stdout[-3000:] + exported.stderr[-3000:]
    return module_tmp, fit.stdout


@pytest.mark.multiprocess
def test_run_summary_prints_the_export_path(trained):
    _, output = trained
    assert "exported to     run/at_end" in output


@pytest.mark.multiprocess
def test_export_command_matches_the_export_at_train_end(trained):
    root, _ = trained
    from_checkpoint = load_file(root / "exported" / "model.safetensors")
    at_end = load_file(root / "run" / "at_end" / "model.safetensors")
    assert sorted(from_checkpoint) == sorted(at_end)
    assert all(torch.equal(from_checkpoint[name], at_end[name]) for name in at_end)


@pytest.mark.multiprocess
def test_auto_classes_load_and_generate(trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, _ = trained
    tokenizer = AutoTokenizer.from_pretrained(root / "exported", local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(root / "exported", local_files_only=True)
    text = "def main():\n    ré"
    assert tokenizer.encode(text, add_special_tokens=False) == ByteTokenizer().encode(text)  # trained with it
    prompt = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    generated = model.generate(**prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert generated.shape == (1, prompt["input_ids"].shape[1] + 4)
    assert isinstance(tokenizer.decode(generated[0]), str)


def test_checkpoint_without_a_recorded_config_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr("lightning_hpz.hf_export._consolidated", lambda path: {"state_dict": {}})
    with pytest.raises(ExportError, match=r"not written by a lightning_hpz LanguageModel.*lightning-hpz consolidate"):
        export_checkpoint(tmp_path, tmp_path / "out")
