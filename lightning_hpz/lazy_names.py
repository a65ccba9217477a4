"""Public names of a package that load their module on first use (PEP 562), so importing the package stays cheap."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_names(package: str, modules: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: each name in ``modules`` is read from the module it maps to
    (relative to ``package``), imported when the name is first used. Nothing is cached in the package, so a name
    always reflects its defining module (tests that patch that module see their patch)."""

    def attribute(name: str) -> Any:
        if name not in modules:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{modules[name]}"), name)

    def listing() -> list[str]:
        return sorted([*vars(sys.modules[package]), *modules])

    return attribute, listing
