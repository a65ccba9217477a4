"""`lightning-hpz fit` ends with the package's own message when a run cannot start, not with jsonargparse's noise."""

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_hpz.cli import main
from lightning_hpz.cli.errors import union_failure_reasons

# main(argv) is called in-process here, which is what that warning is about; the command line itself does not warn
pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
QUICKSTART = str(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml")


@pytest.fixture
def malformed_json(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 3,}')
    return path


def _fit_error(*overrides: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", QUICKSTART, *overrides])
    assert isinstance(exit_info.value.code, str), "a message, which also makes the exit status 1"
    return exit_info.value.code.strip()


def test_missing_pretrained_directory(tmp_path):
    message = _fit_error("--model.init_args.pretrained", str(tmp_path / "missing"))
    assert message.startswith("lightning-hpz fit: error: PretrainedModelError: pretrained=")
    assert "is not a directory" in message


def test_hpz_below_stage_3():
    message = _fit_error("--trainer.strategy.init_args.stage", "2")
    assert "hpz_partition_size=2 needs ZeRO stage 3" in message and "Union" not in message


def test_mistyped_strategy_name_gets_the_closest_one():
    message = _fit_error("--trainer.strategy", "hpzz")
    assert "strategy='hpzz' is not a registered strategy name. Did you mean 'hpz'" in message


def test_malformed_json_config_is_the_last_line(malformed_json):
    command = [sys.executable, "-m", "lightning_hpz.cli", "fit", "--config", QUICKSTART]
    command += ["--trainer.strategy.init_args.config", str(malformed_json)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith(f"lightning-hpz fit: error: config='{malformed_json}' is not valid JSON")
    assert "Union subtypes" not in result.stderr and "Traceback" not in result.stderr
    assert "LightningCLI's args parameter" not in result.stdout + result.stderr


def test_union_reasons_leave_out_type_mismatches():
    message = "Does not validate\nErrors:\n  - Expected a <class 'str'>\n  - stage=7 is wrong.\nGiven value type: x"
    assert union_failure_reasons(message) == ["stage=7 is wrong."]
