"""The shipped model recipes: every YAML parses into what it promises, and the quickstart really trains."""

import inspect
import json
import re
from pathlib import Path

import pytest
import yaml
from conftest import QUICKSTART_STEPS
from jsonargparse import Namespace
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser

import lightning_hpz  # noqa: F401 - registers the strategies
from lightning_hpz.models import count_parameters

CONFIGS = Path(__file__).parent.parent / "configs"
REAL_SCALE = ["llama2_7b_hpz.yaml", "llama2_70b_hpz.yaml", "falcon_40b_hpz.yaml", "t5_mt5_hpz.yaml"]
MODEL_RECIPES = ["quickstart.yaml", *REAL_SCALE]


def _parse(name: str) -> Namespace:
    """Parse a recipe as `lightning-hpz fit --config` does, without building the Trainer or the model."""
    parser = LightningArgumentParser(exit_on_error=False)
    parser.add_lightning_class_args(Trainer, "trainer")
    parser.add_lightning_class_args(LightningModule, "model", subclass_mode=True)
    parser.add_lightning_class_args(LightningDataModule, "data", subclass_mode=True)
    parser.add_argument("--seed_everything", type=int)
    return parser.parse_path(str(CONFIGS / name))


@pytest.mark.parametrize("name", MODEL_RECIPES)
def test_recipe_parses_with_known_arguments(name):
    config = _parse(name)
    for section in ("model", "data"):
        cls = _import(config[section].class_path)
        given = yaml.safe_load((CONFIGS / name).read_text())[section]["init_args"]
        assert set(given) <= set(inspect.signature(cls).parameters), (name, section)
    assert config.trainer.strategy.class_path == "lightning_hpz.HpzStrategy"


def test_quickstart_is_tiny_llama2_under_hpz_on_four_cpu_processes():
    config = _parse("quickstart.yaml")
    strategy = config.trainer.strategy.init_args
    assert (config.trainer.accelerator, config.trainer.devices) == ("cpu", 4)
    assert (strategy.stage, strategy.hpz_partition_size) == (3, 2)
    assert isinstance(strategy.config, dict), "the DeepSpeed config reached the strategy as a string"
    assert strategy.config["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    assert config.model.init_args.preset == "llama2-tiny" and config.data.init_args.source == "default"


@pytest.mark.parametrize("name", REAL_SCALE)
def test_real_scale_recipe_uses_the_papers_setting(name):
    config = _parse(name)
    assert (config.trainer.accelerator, config.trainer.devices) == ("gpu", 8)
    assert config.trainer.strategy.init_args.hpz_partition_size == 8
    assert config.trainer.precision == "bf16-mixed"
    assert config.model.init_args.activation_checkpointing is True
    assert count_parameters(config.model.init_args.preset) > 1e9


def _import(path: str):
    module, _, name = path.rpartition(".")
    return getattr(__import__(module, fromlist=[name]), name)


@pytest.mark.multiprocess
def test_quickstart_trains_and_reports(quickstart_run):
    """The README's first command, cut to 40 steps: the loss falls by a third; the summary says where things are; the
    progress bar counts the steps."""
    root, completed = quickstart_run
    summary = json.loads((root / "runs/quickstart/summary.json").read_text())
    assert summary["steps"] == QUICKSTART_STEPS
    assert summary["last_loss"] < summary["first_loss"] * 2 / 3, summary
    assert 1 < summary["val_perplexity"] < 384  # better than uniform over the tiny vocabulary
    assert summary["tokens_per_second"] > 0
    assert (root / summary["checkpoint"]).is_dir()  # a sharded DeepSpeed checkpoint
    assert f"training summary ({QUICKSTART_STEPS} steps, completed)" in completed.stdout
    # the bar counts the steps of a run max_steps ends, without a negative epoch count ("Epoch 0/-2")
    assert re.search(rf"Epoch 0: [^\r\n]*\b{QUICKSTART_STEPS}/{QUICKSTART_STEPS}\b", completed.stdout)
    assert "Epoch 0/" not in completed.stdout
