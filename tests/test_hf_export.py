"""From `lightning-hpz fit` (the quickstart run of test_quickstart.py) to a directory the Auto classes load and use."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_hpz.checkpointing.hf_export import ExportError, export_checkpoint
from lightning_hpz.data.tokenizers import ByteTokenizer


def _cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "lightning_hpz.cli", *argv]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=cwd, env=env)


@pytest.fixture(scope="module")
def trained(quickstart_run):
    """The quickstart run (a tiny Llama-2, hpZ, exported at the end), exported again from its sharded checkpoint."""
    root, fit = quickstart_run
    summary = json.loads((root / "runs" / "quickstart" / "summary.json").read_text())
    exported = _cli("export", str(root / summary["checkpoint"]), "exported", cwd=root)
    assert exported.returncode == 0, exported.stdout[-3000:] + exported.stderr[-3000:]
    return root, fit.stdout


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
    monkeypatch.setattr("lightning_hpz.checkpointing.hf_export._consolidated", lambda path: {"state_dict": {}})
    with pytest.raises(ExportError, match=r"not written by a lightning_hpz LanguageModel.*lightning-hpz consolidate"):
        export_checkpoint(tmp_path, tmp_path / "out")
