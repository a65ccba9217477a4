"""``make test-versions``: a short subset of the suite in a fresh environment per supported DeepSpeed minor, per
supported Lightning minor, and on the newest torch (docs/versions.md).

Each environment is a virtual environment over this interpreter's packages (``python -m venv
--system-site-packages``) into which only the release that differs is installed, so one combination costs one
``pip install``. The subset runs with that environment's python against this checkout (``PYTHONPATH``); DeepSpeed's
JIT ops are built into the environment's own torch-extensions folder, because another DeepSpeed or torch would
rebuild, and replace, the op the main environment uses.

    python tests/version_matrix.py                 # every combination
    python tests/version_matrix.py deepspeed-0.16  # some of them
    python tests/version_matrix.py --list

Environments are kept under ``build/versions/<name>`` and reused while their requirement is unchanged; each run
writes ``build/versions/<name>.log`` and the table ``build/versions/results.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
ENVIRONMENTS = REPOSITORY / "build" / "versions"

# name -> the one requirement that differs from the main environment (the newest patch release of each minor)
COMBINATIONS = {
    "deepspeed-0.16": "deepspeed==0.16.9",
    "deepspeed-0.17": "deepspeed==0.17.6",
    "deepspeed-0.18": "deepspeed==0.18.9",
    "deepspeed-0.19": "deepspeed==0.19.8",
    "lightning-2.5": "lightning==2.5.6",
    "lightning-2.6": "lightning==2.6.6",
    "torch-2.7": "torch==2.7.1",  # the oldest torch the package declares (LitGPT needs 2.7, transformers 5 needs 2.6)
    "torch-2.15": "torch==2.15.0",
}

# The promises every supported combination keeps, on 4 CPU ranks, most on the toy that ends in a layer with one
# output (a one-element bias, the parameter DeepSpeed #6659 crashed on): hpZ 2 and 4 equal hpZ 1; the emulated race
# (`none` corrupts, `event` is exact, on the coalesced and the sequential gathers); an exact mid-epoch resume; no stale
# secondaries after writes under GatheredParameters; hpZ 2 = hpZ 1 with frozen and tied weights, activation
# checkpointing, bf16, accumulation and an optimizer offloaded to the CPU (DeepSpeed #6926); a Fabric loop; LitGPT's
# pretrain loop; the version guards and the construction-time refusals of upstream hpZ bugs.
SUBSET = [
    "tests/test_strategy_training.py::test_hpz_losses_identical_to_plain_zero3",
    "tests/test_strategy_training.py::test_resume_mid_epoch_continues_exactly",
    "tests/test_race_emulation.py::test_unordered_copy_reproduces_the_failure",
    "tests/test_race_emulation.py::test_ordered_copy_matches_plain_zero3_exactly[event]",
    "tests/test_race_emulation.py::test_ordered_copy_matches_plain_zero3_exactly[event-sequential]",
    "tests/test_secondary_partitions.py",
    "tests/test_hpz_combinations.py",
    "tests/test_fabric_training.py::test_hpz2_with_event_ordering_matches_hpz1_exactly",
    "tests/test_litgpt_loops.py::test_pretrain_main_hpz2_equals_hpz1_and_ddp",
    "tests/test_deepspeed_guard.py",
    "tests/test_upstream_bugs.py",
]

VERSIONS_PROBE = (
    "import json, deepspeed, lightning, torch; "
    "print(json.dumps({'deepspeed': deepspeed.__version__, 'lightning': lightning.__version__, "
    "'torch': torch.__version__}))"
)


def prepare(name: str, requirement: str) -> Path:
    """The environment ``name`` with ``requirement`` installed (built once, reused while the requirement holds)."""
    environment = ENVIRONMENTS / name
    marker = environment / "requirement.txt"
    python = environment / "bin" / "python"
    if marker.is_file() and marker.read_text() == requirement and python.exists():
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", "--system-site-packages", str(environment)], check=True)
    # A machine-wide pip constraint may cap a package below the release under test (a local wheel cache): the
    # requirement named here is the one to install.
    env = {**os.environ, "PIP_CONSTRAINT": os.devnull}
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", requirement], check=True, env=env)
    marker.write_text(requirement)
    return python


def installed_versions(python: Path) -> dict[str, str]:
    probe = subprocess.run([str(python), "-c", VERSIONS_PROBE], capture_output=True, text=True, check=True)
    return json.loads(probe.stdout.strip().splitlines()[-1])


def run_subset(name: str, python: Path) -> dict:
    """Run the subset in environment ``name``; its outcome as counts, the failed tests, and the time taken."""
    report = ENVIRONMENTS / f"{name}.xml"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")])),
        "TORCH_EXTENSIONS_DIR": str(python.parents[1] / "torch_extensions"),
        "CI": "true",  # the subset's tests run whatever their markers
    }
    command = [str(python), "-m", "pytest", *SUBSET, "-p", "no:cacheprovider", "-q", f"--junitxml={report}"]
    start = time.monotonic()
    with open(ENVIRONMENTS / f"{name}.log", "w") as log:
        code = subprocess.run(command, cwd=REPOSITORY, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    outcome = {"code": code, "minutes": (time.monotonic() - start) / 60, **junit_counts(report)}
    return outcome


def junit_counts(report: Path) -> dict:
    if not report.is_file():
        return {"passed": 0, "failed": [], "skipped": 0}
    failed, skipped, total = [], 0, 0
    for case in ET.parse(report).iter("testcase"):
        total += 1
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(case.get("name"))
        elif case.find("skipped") is not None:
            skipped += 1
    return {"passed": total - len(failed) - skipped, "failed": failed, "skipped": skipped}


def table_row(name: str, versions: dict[str, str], outcome: dict) -> str:
    failed = ", ".join(outcome["failed"]) or "-"
    return (
        f"| {name} | {versions.get('deepspeed', '?')} | {versions.get('lightning', '?')} | "
        f"{versions.get('torch', '?')} | {outcome['passed']} | {failed} | {outcome['skipped']} | "
        f"{outcome['minutes']:.1f} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"combinations to run (default: all of {', '.join(COMBINATIONS)})")
    parser.add_argument("--list", action="store_true", help="list the combinations and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, requirement in COMBINATIONS.items():
            print(f"{name}: {requirement}")
        return 0
    unknown = [name for name in args.names if name not in COMBINATIONS]
    if unknown:
        parser.error(f"unknown combination(s) {unknown}; choose from {list(COMBINATIONS)}")
    ENVIRONMENTS.mkdir(parents=True, exist_ok=True)
    failures = 0
    for name in args.names or list(COMBINATIONS):
        python = prepare(name, COMBINATIONS[name])
        versions = installed_versions(python)
        print(f"[test-versions] {name}: {versions}", flush=True)
        outcome = run_subset(name, python)
        failures += outcome["code"] != 0
        (ENVIRONMENTS / f"{name}.row").write_text(table_row(name, versions, outcome))
    # the latest outcome of every combination run so far, this run's and earlier ones'
    rows = [
        (ENVIRONMENTS / f"{name}.row").read_text() for name in COMBINATIONS if (ENVIRONMENTS / f"{name}.row").is_file()
    ]
    header = "| combination | DeepSpeed | Lightning | torch | passed | failed | skipped | minutes |\n|" + "---|" * 8
    (ENVIRONMENTS / "results.md").write_text("\n".join([header, *rows]) + "\n")
    print("\n".join([header, *rows]))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
