"""SIGTERM in every phase of a Trainer run, and in a Fabric loop: two real ZeRO-3 ranks over gloo, rank 0 signalled.

Each test is one row of the table in docs/operations.md, "Preemption": the exit code, the seconds from the signal
to the exit of every rank (bounded: no hang), and whether a checkpoint was committed. 75 only with a checkpoint of
this run committed; 143 when the run had nothing to save; never 0. The ranks are forked from the warm launcher as
torchrun would start them (every rank reports the code); Lightning's own launcher is covered by test_preemption.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from conftest import run_script

from lightning_hpz.lifecycle.run_exit import PREEMPTED_EXIT_CODE, PREEMPTED_NOTHING_SAVED_EXIT_CODE

pytestmark = pytest.mark.multiprocess

SECONDS_TO_EXIT = 90  # measured 10-20 s on a loaded 2-core machine; a deadlock would reach the launch's timeout


class PhaseRuns:
    """Launches each phase at most once per module (the load phase resumes the training phase's checkpoint)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.results: dict[str, dict] = {}

    def __call__(self, phase: str, script: str = "preemption_phases.py", **options) -> dict:
        if phase not in self.results:
            out = self.root / phase
            run = run_script(script, {"phase": phase, **options}, out, timeout=300, ranks=2)
            ended = time.time()
            signalled = json.loads((out / "signal.json").read_text())["time"]
            self.results[phase] = {
                "code": run.returncode,
                "seconds": ended - signalled,
                "ranks": run.ranks,
                "output": run.output[-4000:],
                "root": out / "root",
            }
            _append_to_table(self.root / "table.md", phase, self.results[phase])
        return self.results[phase]


def _append_to_table(table: Path, phase: str, result: dict) -> None:
    checkpoint = result["ranks"].get(0, {}).get("checkpoint")
    line = f"| {phase} | {result['code']} | {result['seconds']:.1f} | {'yes' if checkpoint else 'no'} |\n"
    with table.open("a") as written:
        written.write(line)


@pytest.fixture(scope="module")
def phases(module_tmp: Path) -> PhaseRuns:
    return PhaseRuns(module_tmp)


def _assert_ended(result: dict, code: int) -> None:
    assert result["code"] == code, result["output"]
    assert [result["ranks"][rank]["exit"] for rank in (0, 1)] == [code, code], result["output"]
    assert result["seconds"] < SECONDS_TO_EXIT


def _assert_committed(result: dict) -> None:
    paths = {result["ranks"][rank]["checkpoint"] for rank in (0, 1)}
    assert len(paths) == 1 and None not in paths, "every rank names the same committed checkpoint"
    assert (Path(paths.pop()) / "latest").is_file()


def _assert_nothing_committed(result: dict) -> None:
    assert [result["ranks"][rank]["checkpoint"] for rank in (0, 1)] == [None, None]
    assert not list(result["root"].glob("hpc_ckpt_*")), "nothing was trained: no checkpoint"


def test_sigterm_during_training_commits_and_exits_75(phases):
    result = phases("train")
    _assert_ended(result, PREEMPTED_EXIT_CODE)
    _assert_committed(result)
    assert result["ranks"][0]["step"] == result["ranks"][1]["step"] < 12


def test_sigterm_during_a_checkpoint_save_commits_the_next_step_and_exits_75(phases):
    result = phases("save")
    _assert_ended(result, PREEMPTED_EXIT_CODE)
    _assert_committed(result)


def test_sigterm_during_validation_inside_fit_commits_and_exits_75(phases):
    result = phases("fit_validation")
    _assert_ended(result, PREEMPTED_EXIT_CODE)
    _assert_committed(result)
    assert result["ranks"][0]["step"] == 5, "committed at the step validation ran after"


@pytest.mark.parametrize(
    "phase",
    ["sanity", "validate", *(pytest.param(phase, marks=pytest.mark.slow) for phase in ("test", "predict"))],
)
def test_sigterm_before_anything_trained_exits_143_without_a_checkpoint(phases, phase):
    # the sanity check, and trainer.validate / test / predict: nothing of this run to save
    result = phases(phase)
    _assert_ended(result, PREEMPTED_NOTHING_SAVED_EXIT_CODE)
    _assert_nothing_committed(result)


@pytest.mark.slow
def test_sigterm_during_the_checkpoint_load_of_a_resume_exits_143_and_keeps_the_checkpoint(phases):
    resumed_from = phases("train")["ranks"][0]["checkpoint"]
    result = phases("load", resume_from=resumed_from)
    _assert_ended(result, PREEMPTED_NOTHING_SAVED_EXIT_CODE)
    _assert_nothing_committed(result)
    assert result["ranks"][0]["step"] == phases("train")["ranks"][0]["step"], "restored, then stopped before a step"
    assert (Path(resumed_from) / "latest").is_file(), "the checkpoint resumed from is still there to resume again"


def test_fabric_loop_polling_preemption_saves_together_and_exits_75(phases):
    result = phases("fabric", script="fabric_preemption.py", signal_at=3)
    _assert_ended(result, PREEMPTED_EXIT_CODE)
    _assert_committed(result)
    assert [result["ranks"][rank]["step"] for rank in (0, 1)] == [4, 4], "both ranks stopped after the signalled step"
