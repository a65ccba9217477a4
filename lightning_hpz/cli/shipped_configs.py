"""The configs that ship with the package (``configs/*.yaml``, ``configs/study/*.yaml``), reachable from any folder.

In a clone they are the repository's ``configs/`` (``lightning_hpz/configs`` links to it); an installed wheel holds
them as package data under ``lightning_hpz/configs``. A ``--config`` value that is no file is looked up there, so
``lightning-hpz fit --config configs/quickstart.yaml``, ``--config quickstart.yaml`` and ``--config quickstart`` all
find the quickstart after a ``pip install``; a file of that name in the working folder always comes first.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

SHIPPED = Path(__file__).resolve().parents[1] / "configs"
_OPTIONS = ("--config", "-c")


def shipped_config(value: str) -> Optional[Path]:
    """The shipped config ``value`` names when it is no file here: a path under ``configs/`` or a bare name, with or
    without ``.yaml``; None when it names none."""
    if Path(value).exists():
        return None
    name = Path(value)
    if name.parts[:1] == ("configs",):
        name = Path(*name.parts[1:])
    if not name.parts or ".." in name.parts or name.is_absolute():
        return None
    for candidate in (SHIPPED / name, SHIPPED / f"{name}.yaml"):
        if candidate.is_file():
            return candidate
    return None


def with_shipped_configs(argv: Sequence[str]) -> list[str]:
    """``argv`` with each ``--config``/``-c`` value naming a shipped config replaced by its path (said on stderr)."""
    resolved = list(argv)
    for index, argument in enumerate(resolved):
        option, equals, value = argument.partition("=")
        if equals and option in _OPTIONS:
            position, value = index, value
        elif argument in _OPTIONS and index + 1 < len(resolved):
            position, value = index + 1, resolved[index + 1]
        else:
            continue
        found = shipped_config(value)
        if found is not None:
            print(f"lightning-hpz: no file {value} here; using the shipped config {found}", file=sys.stderr)
            resolved[position] = f"{option}={found}" if equals else str(found)
    return resolved


def shipped_names() -> list[str]:
    """Every shipped config, as ``--config`` takes it (``quickstart``, ``study/cpu_small``)."""
    return sorted(str(path.relative_to(SHIPPED).with_suffix("")) for path in SHIPPED.rglob("*.yaml"))
