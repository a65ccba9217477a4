"""A whole job SIGKILLed during its saves, ten times in a row, never loses the checkpoint a save reported committed.

One job (2 CPU ranks, ZeRO-3, ``last.ckpt`` saved after every step) is started in a process group of its own (ranks
forked from the warm launcher, as torchrun starts them) and killed whole, then restarted with ``ckpt_path="last"``,
as a requeued job is: four times at a commit fault point (the n-th commit of the launch, the process group killed from
inside the commit) and six times at a random instant (the test kills the process group while the job saves every
step, so most kills land inside a save). Each restart must resume from a step no older than the last one a save had
reported committed, and the last launch trains to the end.
"""

import itertools
import json
import os
import random
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import SCRIPTS, WARM

from lightning_hpz.checkpointing.fault_points import FAULT_AT_ENV_VAR, FAULT_POINT_ENV_VAR, FAULT_SCOPE_ENV_VAR
from lightning_hpz.checkpointing.manifest import read_manifest, verify_files

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

_WAITER = ThreadPoolExecutor(1)  # waits for the running launch while the test watches and kills it
MAX_STEPS = 45  # ten launches train 2-3 steps each before their kill: the last one must still have work
KILLS = [
    ("commit:manifest_written", 2),
    ("commit:new_in_place", 2),
    ("random", None),
    ("random", None),
    ("commit:manifest_written", 3),
    ("random", None),
    ("commit:new_in_place", 3),
    ("random", None),
    ("random", None),
    ("random", None),
]


def _committed_steps(out: Path) -> list[int]:
    progress = out / "progress.txt"
    return [int(line) for line in progress.read_text().split()] if progress.exists() else []


def _launch(out: Path, launch: int, fault: tuple[str, int] | None) -> Future:
    """The job's two ranks forked from the warm launcher, as torchrun starts them, in a process group of their own
    (with the launcher that waits for them); the launch's exit code and output once it ends."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for name in ("MASTER_PORT", "MASTER_ADDR", FAULT_POINT_ENV_VAR, FAULT_AT_ENV_VAR, FAULT_SCOPE_ENV_VAR):
        env.pop(name, None)
    if fault is not None:
        env.update({FAULT_POINT_ENV_VAR: fault[0], FAULT_AT_ENV_VAR: str(fault[1]), FAULT_SCOPE_ENV_VAR: "job"})
    options = json.dumps({"out": str(out), "max_steps": MAX_STEPS, "launch": launch})
    return _WAITER.submit(WARM.run, str(SCRIPTS / "killed_saves.py"), [options], str(out), env, 2, 300)


def _kill_at_random(job: Future, out: Path, launch: int, already: int, chance: random.Random) -> None:
    """Once the launch has committed a step of its own, SIGKILL its process group at a random instant."""
    deadline = time.monotonic() + 240
    while len(_committed_steps(out)) <= already and not job.done() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(chance.uniform(0.0, 0.5))
    os.killpg(_resumed_from(out, launch)["process_group"], signal.SIGKILL)


def _resumed_from(out: Path, launch: int) -> dict:
    return json.loads((out / f"start{launch}.json").read_text())


def test_ten_whole_job_kills_during_saves_never_lose_a_reported_commit(tmp_path):
    out = tmp_path / "job"
    out.mkdir()
    chance = random.Random(30)
    rows = []
    for launch, (point, count) in enumerate([*KILLS, (None, None)]):
        reported = _committed_steps(out)
        job = _launch(out, launch, None if point in (None, "random") else (point, count))
        if point == "random":
            _kill_at_random(job, out, launch, len(reported), chance)
        code, output = job.result(timeout=330)
        (out / f"launch{launch}.log").write_text(output)
        resumed = _resumed_from(out, launch)["start_step"]
        last_reported = max(reported, default=0)
        assert resumed >= last_reported, (launch, point, resumed, last_reported, (out / f"launch{launch}.log"))
        if point is None:
            assert code == 0 and _resumed_from(out, launch)["end_step"] == MAX_STEPS
        else:
            assert code == -signal.SIGKILL, (launch, code, (out / f"launch{launch}.log").read_text()[-3000:])
        rows.append([launch, point or "none (trains to the end)", count, code, resumed, max(_committed_steps(out))])
    last = out / "ckpts" / "last.ckpt"
    assert read_manifest(last)["run"]["global_step"] == MAX_STEPS
    assert verify_files(last, read_manifest(last), list(read_manifest(last)["files"])) == []
    # each kill beside what the restart after it found: the last step reported committed, the step resumed from
    table = ["| launch | killed at | commit no. | exit | last step reported committed | next launch resumed from |"]
    for (launch, point, count, code, _, reported), following in itertools.pairwise(rows):
        table.append(f"| {launch} | {point} | {count or '-'} | {code} | {reported} | {following[4]} |")
    print("\n".join(table))
