"""Preempt a 2-rank CPU run many times, at random steps, and print what each try ended with.

    python benchmarks/preemption_repeat.py --tries 5

Each try starts ``tests/scripts/preemption_training.py`` (ZeRO-3, a signal lands mid-training), sends SIGTERM the way
a scheduler does, and records the exit code, the seconds from signal to exit, the step reached and whether the
checkpoint was committed. Ways of delivery: to the launching process only (``kill PID``), to the whole process
group (``kill -- -PGID``), and to torchrun. Not a pass/fail test: timings vary with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "scripts" / "preemption_training.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def one_try(delivery: str, out: Path, signal_step: int, steps: int) -> dict:
    options = json.dumps({"out": str(out), "steps": steps, "stage": 3, "step_seconds": 0.3})
    command = [*TORCHRUN, str(SCRIPT), options] if delivery == "torchrun" else [sys.executable, str(SCRIPT), options]
    log = open(out.parent / f"{out.name}.log", "w")  # noqa: SIM115 - lives as long as the process
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    record = out / "rank0.json"
    while process.poll() is None:
        try:
            if json.loads(record.read_text())["step"] >= signal_step:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    sent = time.monotonic()
    if delivery == "group":
        os.killpg(process.pid, signal.SIGTERM)
    else:
        process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        code = "deadlock (killed after 300 s)"
    final = json.loads(record.read_text())
    checkpoint = final.get("checkpoint")
    return {
        "delivery": delivery,
        "signal_at_step": signal_step,
        "exit": code,
        "seconds": round(time.monotonic() - sent, 1),
        "stopped_at_step": final["step"],
        "committed": bool(checkpoint and (Path(checkpoint) / "latest").is_file()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tries", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--deliveries", default="main,group,torchrun")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for delivery in args.deliveries.split(","):
            for attempt in range(args.tries):
                out = Path(tmp) / f"{delivery}-{attempt}"
                rows.append(one_try(delivery, out, rng.randint(2, args.steps // 3), args.steps))
                print(json.dumps(rows[-1]), flush=True)
    print("\n| delivery | signal at step | exit | seconds to exit | stopped at step | checkpoint committed |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(
            f"| {row['delivery']} | {row['signal_at_step']} | {row['exit']} | {row['seconds']} | "
            f"{row['stopped_at_step']} | {row['committed']} |"
        )


if __name__ == "__main__":
    main()
