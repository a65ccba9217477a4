"""Register the strategy names in Lightning's registries (Trainer and Fabric) without importing Lightning ourselves.

``import lightning_hpz`` must make ``Trainer(strategy="hpz")`` work, and the ``lightning-hpz`` tools must answer in
well under a second, which rules out importing torch and Lightning with the package. So the names are registered as
soon as Lightning's trainer package is imported, whichever is imported first: right away when it already is,
otherwise from a one-shot import hook that runs after ``lightning.pytorch`` has finished loading (the registry and
every strategy exist by then) and no module of this package is halfway through its own import.
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
    # Importing the strategy modules registers the names at their end (the Trainer's and Fabric's registries).
    # `import lightning` loads both lightning.fabric and lightning.pytorch, so one hook serves both.
    importlib.import_module("lightning_hpz.strategy.trainer_strategy")
    importlib.import_module("lightning_hpz.strategy.fabric_strategy")
    # a mistyped name gets the closest of ours in Lightning's own error (Trainer and Fabric, not only the CLI)
    importlib.import_module("lightning_hpz.strategy.name_hint").add_name_hints()


class _RegisterAfterLightning(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands out the real specs of ``lightning.pytorch`` and of this package's modules with
    loaders that report when they finish, and registers once Lightning is loaded and none of our modules is halfway.

    The second condition matters when one of our modules is what imports Lightning (``from
    lightning_hpz.exact_resume.data_order import ...`` first): registering right then would import the strategy,
    which imports that half-run module back.
    """

    def __init__(self) -> None:
        self.lightning_loaded = False
        self.modules_running = 0  # our modules whose code is executing right now (nested imports count each)

    def find_spec(self, fullname: str, path: Any, target: Optional[ModuleType] = None) -> Any:
        if fullname != LIGHTNING_TRAINER_PACKAGE and not fullname.startswith("lightning_hpz."):
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = getattr(finder, "find_spec", lambda *_: None)(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _ReportingLoader(spec.loader, self, is_lightning=fullname == LIGHTNING_TRAINER_PACKAGE)
                return spec
        return None

    def finished(self, is_lightning: bool) -> None:
        self.lightning_loaded = self.lightning_loaded or is_lightning
        if self.lightning_loaded and self.modules_running == 0 and self in sys.meta_path:
            sys.meta_path.remove(self)  # one shot: the imports of the registration must not come back here
            register_now()


class _ReportingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, finder: _RegisterAfterLightning, is_lightning: bool) -> None:
        self._loader = loader
        self._finder = finder
        self._is_lightning = is_lightning

    def create_module(self, spec: Any) -> Optional[ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        counted = not self._is_lightning
        self._finder.modules_running += counted
        try:
            self._loader.exec_module(module)
        finally:
            self._finder.modules_running -= counted
        self._finder.finished(self._is_lightning)  # not after a failed import: its error must stay the one raised

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, get_data, ... of the real loader
        return getattr(self._loader, name)
