"""Wall time of the ``lightning-hpz`` tool commands a new user types first (median of a few runs).

    python benchmarks/cli_startup.py --repeats 3

Targets: ``--help`` and ``strategies`` under 1 s (they import no torch). ``presets`` builds every preset on the meta
device and ``bench --help`` imports the benchmark's torch workload, so they pay for torch. The numbers depend on the
machine's load: this prints them, no test asserts on them.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS = [["--help"], ["strategies"], ["plan", "--help"], ["presets"], ["bench", "--help"]]


def seconds(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "lightning_hpz.cli", *argv], check=True, capture_output=True, timeout=600)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    interpreter = statistics.median(
        _timed([sys.executable, "-c", "pass"]) for _ in range(args.repeats)
    )  # the floor every command pays
    print(f"{'command':<28} {'median (s)':>10}   (python -c pass: {interpreter:.3f} s)")
    for argv in COMMANDS:
        median = statistics.median(seconds(argv) for _ in range(args.repeats))
        print(f"{'lightning-hpz ' + ' '.join(argv):<28} {median:>10.3f}")


def _timed(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, timeout=60)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
