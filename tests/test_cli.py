"""The LightningCLI entry point: every shipped YAML parses; both strategy forms train through `lightning-hpz fit`."""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Union

import pytest
from jsonargparse import ArgumentParser
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import Strategy, StrategyRegistry

import lightning_hpz  # registers the strategy names the configs use
from lightning_hpz.cli import shipped_configs

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "configs").glob("*.yaml"))
TEST_CONFIGS = sorted((Path(__file__).parent / "configs").glob("*.yaml"))


def _parser() -> LightningArgumentParser:
    parser = LightningArgumentParser(exit_on_error=False)
    parser.add_argument("--seed_everything", type=int | bool, default=True)
    parser.add_lightning_class_args(Trainer, "trainer")
    parser.add_lightning_class_args(LightningModule, "model", subclass_mode=True)
    parser.add_lightning_class_args(LightningDataModule, "data", subclass_mode=True, required=False)
    return parser


@pytest.mark.parametrize("path", SHIPPED + TEST_CONFIGS, ids=lambda p: p.name)
def test_config_parses(path, monkeypatch):
    # parsed with the classes resolved and the arguments type-checked, without building a model or a Trainer
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "scripts"))
    config = _parser().parse_path(str(path))
    assert config.model.class_path
    # the strategy is built for real (not the Trainer: shipped configs may ask for GPUs)
    strategy = _instantiate_strategy(config.trainer.strategy)
    assert isinstance(strategy, (str, Strategy))
    if isinstance(strategy, str):
        assert strategy in StrategyRegistry


def _instantiate_strategy(value):
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--strategy", type=Union[str, Strategy])
    return parser.instantiate_classes(parser.parse_object({"strategy": value})).strategy


def test_shipped_configs_exist():
    assert SHIPPED, "configs/ must ship at least the quickstart"


def _fit(config: Path, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent / "scripts"), "TOY_TRAINING_OUT": str(out)}
    command = [sys.executable, "-m", "lightning_hpz.cli", "fit", "--config", str(config)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=out.parent)


@pytest.mark.multiprocess
def test_fit_through_cli_with_the_strategy_as_class_path(tmp_path):
    out = tmp_path / "out"
    result = _fit(Path(__file__).parent / "configs" / "toy_hpz_class_path.yaml", out)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(record["strategy"] == "HpzStrategy" for record in records)
    assert all(len(record["losses"]) == 6 for record in records)
    assert records[0]["zero_config"]["zero_hpz_partition_size"] == 2
    assert records[0]["zero_config"]["stage"] == 3


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")  # args given in-process, on purpose
def test_strategy_by_name_builds_the_hpz_strategy_through_cli(monkeypatch):
    # `strategy: hpz` resolves to the very HpzStrategy the class_path launch above trains with; built, not launched
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "scripts"))
    config = Path(__file__).parent / "configs" / "toy_hpz_by_name.yaml"
    cli = LightningCLI(
        run=False, subclass_mode_model=True, args=["--config", str(config)], auto_configure_optimizers=False
    )
    strategy = cli.trainer.strategy
    assert type(strategy) is lightning_hpz.HpzStrategy and strategy.num_processes == 2
    assert strategy.config["zero_optimization"]["zero_hpz_partition_size"] == 1  # "auto" is off on a single node
    assert strategy.config["zero_optimization"]["stage"] == 3


def test_unknown_command_lists_commands():
    result = subprocess.run(
        [sys.executable, "-m", "lightning_hpz.cli", "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0
    assert "fit" in result.stdout and "strategies" in result.stdout and "consolidate" in result.stdout
    assert "quickstart" in result.stdout and "study/cpu_small" in result.stdout  # the shipped configs, by name


def test_shipped_configs_are_the_repository_configs_and_all_packaged():
    # lightning_hpz/configs links to configs/; pyproject's package-data puts every file of it into the wheel
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    assert shipped_configs.SHIPPED.resolve() == ROOT / "configs"
    packaged = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    files = {path.relative_to(ROOT / "configs") for path in (ROOT / "configs").rglob("*") if path.is_file()}
    covered = set()
    for package, patterns in packaged.items():
        folder = ROOT / Path(*package.split("."))
        covered |= {path.relative_to(shipped_configs.SHIPPED) for pattern in patterns for path in folder.glob(pattern)}
    assert files and files == covered


def test_a_config_that_is_no_file_names_a_shipped_one(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # any folder: no configs/ here
    quickstart = shipped_configs.SHIPPED / "quickstart.yaml"
    for name in ("configs/quickstart.yaml", "quickstart.yaml", "quickstart"):
        assert shipped_configs.shipped_config(name) == quickstart
    assert shipped_configs.shipped_config("study/cpu_small") == shipped_configs.SHIPPED / "study" / "cpu_small.yaml"
    for unknown in ("configs/nothing.yaml", "../configs/quickstart.yaml", "{trainer: {max_steps: 1}}"):
        assert shipped_configs.shipped_config(unknown) is None
    argv = ["fit", "--config=quickstart", "-c", "configs/quickstart.yaml", "--trainer.max_steps=1", "--config", "x"]
    assert shipped_configs.with_shipped_configs(argv) == [
        "fit", f"--config={quickstart}", "-c", str(quickstart), "--trainer.max_steps=1", "--config", "x"
    ]  # fmt: skip
    assert "using the shipped config" in capsys.readouterr().err
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "quickstart.yaml").write_text("seed_everything: 1\n")
    assert shipped_configs.shipped_config("configs/quickstart.yaml") is None  # the user's own file comes first
    assert sorted(shipped_configs.shipped_names()) == sorted(
        str(path.relative_to(ROOT / "configs").with_suffix("")) for path in (ROOT / "configs").rglob("*.yaml")
    )
