"""Messages for settings a new user gets wrong first name what they typed, and `--print_config` shows real defaults."""

import lightning as L
import pytest
import yaml

from lightning_hpz import HpzConfigurationError, HpzStrategy
from lightning_hpz.cli import main

# main(argv) runs in-process here, which is what LightningCLI's `args` warning is about
pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")


def test_zeropp_on_cpu_names_the_preset():
    with pytest.raises(HpzConfigurationError, match=r"strategy='zeropp' .*needs CUDA.*Use strategy='hpz'") as error:
        L.Trainer(strategy="zeropp", accelerator="cpu", devices=2, logger=False)
    assert "quantized_weights" not in str(error.value)  # a flag the user never typed


def test_hpz_on_one_device_per_node_says_why():
    with pytest.raises(HpzConfigurationError, match=r"needs more than one device per node.*devices=N"):
        L.Trainer(strategy=HpzStrategy(hpz_partition_size=2), accelerator="cpu", devices=1, logger=False)


def test_default_stage_leaves_config_stage_free():
    assert HpzStrategy(config={"zero_optimization": {"stage": 2}}).config["zero_optimization"]["stage"] == 2


def test_print_config_shows_the_default_stage(capsys):
    argv = ["fit", "--model", "lightning.pytorch.demos.boring_classes.BoringModel"]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--trainer.strategy.class_path", "lightning_hpz.HpzStrategy", "--print_config"])
    assert not exit_info.value.code
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["strategy"]["init_args"]["stage"] == 3
