"""The study's results as JSON lines, one per finished cell, appended as each cell ends (a resumed study reads them
to skip what is done)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS_FILE = "results.jsonl"


class StudyResumeError(RuntimeError):
    """The results folder holds lines of a study with other settings."""


def read_results(out: Path) -> list[dict[str, Any]]:
    """Every complete line of ``out/results.jsonl`` (a line cut short by a kill is ignored: its cell runs again)."""
    path = out / RESULTS_FILE
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def append_result(out: Path, record: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / RESULTS_FILE).open("a") as results:
        results.write(json.dumps(record) + "\n")
        results.flush()


def finished_cells(records: list[dict[str, Any]], fingerprint: str, retry_failed: bool = False) -> dict[str, Any]:
    """The latest record of each finished cell; refuses records of another configuration."""
    foreign = sorted({r.get("fingerprint") for r in records} - {fingerprint})
    if foreign:
        raise StudyResumeError(
            f"The results folder holds cells measured with other settings (fingerprint {foreign[0]}, this config "
            f"{fingerprint}): steps, data, devices or models changed. Use another --out, or remove {RESULTS_FILE}."
        )
    latest = {r["cell_id"]: r for r in records}
    if retry_failed:
        latest = {cell_id: r for cell_id, r in latest.items() if r["status"] == "ok"}
    return latest
