"""The subprocess cell runner with stand-in commands (plain Python, no training): how a cell's end is classified, and
that a cell that hangs is ended with every process it started."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from lightning_hpz.study.cell_runner import FAILED, OK, OUT_OF_MEMORY, TIMEOUT, SubprocessCellRunner
from lightning_hpz.study.study_config import parse_study_config


def runner_for(script: str, timeout_s: float = 60) -> SubprocessCellRunner:
    """A runner whose cell command is ``python -c SCRIPT SPEC`` (the script reads the spec's ``out``)."""
    config = parse_study_config(
        {
            "devices_per_node": 2,
            "steps": 4,
            "warmup_steps": 1,
            "timeout_s": timeout_s,
            "launcher": [sys.executable, "-c", script, "{spec}"],
            "grid": {"models": ["t5-tiny"], "strategies": ["zero2"], "micro_batch_sizes": [1]},
        }
    )
    return SubprocessCellRunner(config)


WRITE_RANKS = """
import json, sys, pathlib
out = pathlib.Path(json.loads(pathlib.Path(sys.argv[1]).read_text())["out"])
for rank in RANKS:
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank}))
"""


def test_a_cell_whose_ranks_all_wrote_records_is_ok(tmp_path):
    run = runner_for(WRITE_RANKS.replace("RANKS", "(1, 0)"))({"out": str(tmp_path)}, tmp_path)
    assert run.status == OK and [r["rank"] for r in run.ranks] == [0, 1]
    assert json.loads((tmp_path / "spec.json").read_text()) == {"out": str(tmp_path)}


def test_a_missing_rank_or_an_exit_code_is_a_failure_with_the_log_tail(tmp_path):
    script = WRITE_RANKS.replace("RANKS", "(0,)") + "\nprint('rank 1 lost its way')\nsys.exit(3)"
    run = runner_for(script)({"out": str(tmp_path)}, tmp_path)
    assert run.status == FAILED
    assert "exit code 3; 1 of 2 ranks wrote results" in run.error and "rank 1 lost its way" in run.error


def test_an_out_of_memory_error_record_is_classified_as_such(tmp_path):
    script = """
import json, sys, pathlib
out = pathlib.Path(json.loads(pathlib.Path(sys.argv[1]).read_text())["out"])
error = {"rank": 1, "type": "OutOfMemoryError", "message": "CUDA out of memory", "out_of_memory": True}
(out / "rank1.error.json").write_text(json.dumps(error))
sys.exit(1)
"""
    run = runner_for(script)({"out": str(tmp_path)}, tmp_path)
    assert run.status == OUT_OF_MEMORY and run.error == "rank 1: OutOfMemoryError: CUDA out of memory"


def test_a_rank_killed_by_the_kernel_counts_as_out_of_memory(tmp_path):
    run = runner_for("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")({"out": str(tmp_path)}, tmp_path)
    assert run.status == OUT_OF_MEMORY and "SIGKILL" in run.error


def test_a_hanging_cell_times_out_and_every_process_it_started_ends(tmp_path):
    # The command starts a child (as Lightning's launcher starts ranks) and both sleep far past the timeout.
    script = f"""
import subprocess, sys, time, pathlib
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
pathlib.Path({str(tmp_path / "child.pid")!r}).write_text(str(child.pid))
time.sleep(600)
"""
    started = time.monotonic()
    run = runner_for(script, timeout_s=3)({"out": str(tmp_path)}, tmp_path)
    assert run.status == TIMEOUT
    assert time.monotonic() - started < 60
    child = int((tmp_path / "child.pid").read_text())
    assert not _running(child)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="process groups are POSIX")
def test_ranks_still_writing_after_the_command_exits_are_waited_for(tmp_path):
    # Rank 0 exits at once; rank 1 (its child) writes its record a moment later, as a slower rank does.
    script = WRITE_RANKS.replace("RANKS", "(0,)") + (
        "\nimport subprocess\nsubprocess.Popen([sys.executable, '-c', "
        "'import time, json, sys, pathlib; time.sleep(1.5); "
        'pathlib.Path(sys.argv[1]).write_text(json.dumps({"rank": 1}))\', str(out / "rank1.json")])'
    )
    run = runner_for(script)({"out": str(tmp_path)}, tmp_path)
    assert run.status == OK and [r["rank"] for r in run.ranks] == [0, 1]
