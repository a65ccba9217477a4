"""Register the strategy names in Lightning's registries (Trainer and Fabric) without importing Lightning ourselves.

``import lightning_hpz`` must make ``Trainer(strategy="hpz")`` work, and the ``lightning-hpz`` tools must answer in
well under a second, which rules out importing torch and Lightning with the package. So the names are registered as
soon as Lightning's trainer package is imported, whichever is imported first: right away when it already is,
otherwise from a one-shot import hook that runs after ``lightning.pytorch`` has finished loading (the registry and
every strategy exist by then).
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from types import ModuleType
from typing import Any, Optional

LIGHTNING_TRAINER_PACKAGE = "lightning.pytorch"


def register_when_lightning_is_imported() -> None:
    if LIGHTNING_TRAINER_PACKAGE in sys.modules:
        register_now()
    elif not any(isinstance(finder, _RegisterAfterLightning) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterLightning())


def register_now() -> None:
    # Importing the strategy modules registers the names at their end (the Trainer's and Fabric's registries); when
    # that import is what is loading Lightning right now, this returns the half-loaded module and the names follow
    # when it finishes. `import lightning` loads both lightning.fabric and lightning.pytorch, so one hook serves both.
    importlib.import_module("lightning_hpz.strategy")
    importlib.import_module("lightning_hpz.fabric.strategy")
    # a mistyped name gets the closest of ours in Lightning's own error (Trainer and Fabric, not only the CLI)
    importlib.import_module("lightning_hpz.strategy_name_hint").add_name_hints()


class _RegisterAfterLightning(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands out the real spec of ``lightning.pytorch`` with a loader that registers after it."""

    def find_spec(self, fullname: str, path: Any, target: Optional[ModuleType] = None) -> Any:
        if fullname != LIGHTNING_TRAINER_PACKAGE:
            return None
        sys.meta_path.remove(self)  # one shot, and the finders below must not see us again
        for finder in sys.meta_path:
            spec = getattr(finder, "find_spec", lambda *_: None)(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


class _RegisteringLoader(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Optional[ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        register_now()

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, get_data, ... of the real loader
        return getattr(self._loader, name)
