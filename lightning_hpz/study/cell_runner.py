"""Run one study cell in its own processes and say how it ended: ``ok``, ``out_of_memory``, ``failed`` or ``timeout``.

The cell's command is the config's ``launcher`` (srun, torchrun on several nodes, ...) or, by default, torchrun on this
machine (``--standalone``: a free rendezvous port per cell; the ranks start in parallel). The command
runs in a session of its own, so on a timeout the whole process group (every rank) is ended, and nothing of a
crashed cell survives into the next one.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from lightning_hpz.lifecycle.launched_ranks import (
    child_environment,
    clear_rank_records,
    end_process_group,
    read_rank_records,
)
from lightning_hpz.study.study_config import SPEC_PLACEHOLDER, StudyConfig

WORKER_MODULE = "lightning_hpz.study.worker"
OK, OUT_OF_MEMORY, FAILED, TIMEOUT = "ok", "out_of_memory", "failed", "timeout"
_KILLED_BY_KERNEL = (-signal.SIGKILL, 128 + signal.SIGKILL)  # the usual end of a CPU process the OOM killer chose


@dataclass
class CellRun:
    """What a runner reports about one cell: its status, each rank's record, and an error line when it failed."""

    status: str
    ranks: list[dict[str, Any]] = field(default_factory=list)
    error: Optional[str] = None
    wall_s: float = 0.0
    log: Optional[str] = None


# A runner takes the cell's spec (see :func:`cell_spec`) and its folder; tests pass cheap fakes.
CellRunner = Callable[[dict[str, Any], Path], CellRun]


def cell_command(config: StudyConfig, spec_path: Path) -> list[str]:
    template = config.launcher or (
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={config.devices_per_node}"),
        *("-m", WORKER_MODULE, SPEC_PLACEHOLDER),
    )
    return [str(spec_path) if part == SPEC_PLACEHOLDER else part for part in template]


def cell_environment(config: StudyConfig) -> dict[str, str]:
    """This process's environment without another launcher's rendezvous settings, plus the config's ``env``."""
    env = child_environment()
    if config.accelerator == "cpu":
        env["DS_ACCELERATOR"] = "cpu"  # also on a machine that has a GPU
    env.update(config.env)
    return env


class SubprocessCellRunner:
    """Runs each cell as the config's command; a :data:`CellRunner`."""

    def __init__(self, config: StudyConfig) -> None:
        self.config = config

    def __call__(self, spec: dict[str, Any], cell_dir: Path) -> CellRun:
        clear_rank_records(cell_dir)
        spec_path = cell_dir / "spec.json"
        spec_path.write_text(json.dumps(spec, indent=1))
        log_path = cell_dir / "log.txt"
        start = time.monotonic()
        with log_path.open("w") as log:
            process = subprocess.Popen(
                cell_command(self.config, spec_path),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=cell_environment(self.config),
                cwd=cell_dir,
                start_new_session=True,  # its own process group: every rank can be ended together
            )
            try:
                returncode: Optional[int] = process.wait(timeout=self.config.timeout_s)
            except subprocess.TimeoutExpired:
                returncode = None
            finally:
                end_process_group(process)
        run = classify(returncode, cell_dir, expected_ranks=self.config.world_size, log_path=log_path)
        run.wall_s = time.monotonic() - start
        return run


def classify(returncode: Optional[int], cell_dir: Path, expected_ranks: int, log_path: Path) -> CellRun:
    """The outcome from the exit code (``None``: timed out) and the records the ranks wrote."""
    ranks = read_rank_records(cell_dir)
    errors = [json.loads(p.read_text()) for p in sorted(cell_dir.glob("rank*.error.json"))]
    log = str(log_path)
    if returncode is None:
        return CellRun(TIMEOUT, ranks, "did not finish within timeout_s", log=log)
    if any(e.get("out_of_memory") for e in errors):
        first = next(e for e in errors if e.get("out_of_memory"))
        return CellRun(OUT_OF_MEMORY, ranks, f"rank {first['rank']}: {first['type']}: {first['message']}", log=log)
    if errors:
        first = errors[0]
        return CellRun(FAILED, ranks, f"rank {first['rank']}: {first['type']}: {first['message']}", log=log)
    if returncode in _KILLED_BY_KERNEL or _rank_killed(log_path):
        error = f"a rank was killed by SIGKILL (exit {returncode}): the kernel's OOM killer?"
        return CellRun(OUT_OF_MEMORY, ranks, error, log=log)
    if returncode != 0 or len(ranks) != expected_ranks:
        error = f"exit code {returncode}; {len(ranks)} of {expected_ranks} ranks wrote results; last lines: "
        return CellRun(FAILED, ranks, error + _tail(log_path), log=log)
    return CellRun(OK, ranks, log=log)


def _rank_killed(log_path: Path) -> bool:
    """torchrun's report of a rank that died of SIGKILL (it exits 1 itself)."""
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    return "Signal 9 (SIGKILL)" in text or "exitcode  : -9" in text


def _tail(log_path: Path, lines: int = 3) -> str:
    text = log_path.read_text(errors="replace").strip().splitlines() if log_path.exists() else []
    return " | ".join(text[-lines:])[-500:]
