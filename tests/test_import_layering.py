"""Importing lightning_hpz has no side effect on DeepSpeed, and its callbacks and models need no DeepSpeed at all."""

import json
import os
import subprocess
import sys

import pytest
from conftest import SCRIPTS

from lightning_hpz import strategy


@pytest.fixture(scope="module")
def fresh_process():
    completed = subprocess.run(
        [sys.executable, str(SCRIPTS / "import_without_deepspeed.py")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        timeout=240,
    )
    assert completed.returncode == 0, completed.stdout[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def test_every_module_can_be_the_first_one_imported():
    # `from lightning_hpz.exact_resume.data_order import ...` as a script's first line once failed: the module
    # imported Lightning, whose registration hook imported the strategy, which imported the half-run module back
    completed = subprocess.run(
        [sys.executable, str(SCRIPTS / "import_each_module_first.py")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert "lightning_hpz.exact_resume.data_order" in result["modules"] and len(result["modules"]) > 50
    assert result["failures"] == {}, "\n".join(f"{name}:\n{error}" for name, error in result["failures"].items())


def test_callbacks_and_models_work_without_deepspeed(fresh_process):
    assert fresh_process["deepspeed_modules"] == []
    assert fresh_process["callbacks"] == 3
    assert fresh_process["parameters"] > 0  # configure_model built the model without any hpZ step


def test_import_registers_names_without_patching_deepspeed(fresh_process):
    assert fresh_process["registered"] == ["hpz", "zero3", "zeropp"]
    assert fresh_process["wrapped_function_owners"] == ["deepspeed"]


def test_model_code_leaves_secondary_partitions_to_the_strategy():
    # hpZ bookkeeping after `configure_model` is the strategy's (its sharded-init context), not the model's
    from lightning_hpz.models import language_model

    assert [name for name in vars(language_model.LanguageModel) if "secondar" in name] == []
    assert "refresh_secondary_partitions" in strategy.HpzStrategy.model_sharded_context.__wrapped__.__code__.co_names
