"""A mistyped strategy name gets the closest name lightning_hpz registers, in Lightning's own error.

Lightning checks ``strategy=`` against its registry in the Trainer's (and Fabric's) connector, and its ValueError
lists a few of Lightning's own names only: ``Trainer(strategy="hpzz")`` says nothing of ``"hpz"``. That check is
wrapped once, when the names are registered: the same ValueError, with "Did you mean 'hpz'?" added when one of this
package's names is close. Every other error, and every valid name, passes through untouched.
"""

from __future__ import annotations

import difflib
import functools
import importlib
from collections.abc import Callable
from typing import Any, Optional

from lightning_hpz.strategy.presets import STRATEGY_PRESETS

# Lightning internals: the connectors that validate `strategy=` (Trainer, Fabric) and the method that does it.
CONNECTORS = (
    ("lightning.pytorch.trainer.connectors.accelerator_connector", "_AcceleratorConnector"),
    ("lightning.fabric.connector", "_Connector"),
)
CHECK_METHOD = "_check_config_and_set_final_flags"
UNKNOWN_NAME_ERROR = "You selected an invalid strategy name"
_WRAPPED_MARK = "_lightning_hpz_name_hint"


def closest_package_name(name: str) -> Optional[str]:
    """The name registered by lightning_hpz that ``name`` most likely meant, or None when none is close."""
    close = difflib.get_close_matches(name.lower(), [preset[0] for preset in STRATEGY_PRESETS], n=1, cutoff=0.6)
    return close[0] if close else None


def add_name_hints() -> None:
    """Wrap each connector's check once; a Lightning without that method (renamed) is left as it is."""
    for module_name, class_name in CONNECTORS:
        try:
            connector = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue
        check = getattr(connector, CHECK_METHOD, None)
        if check is not None and not getattr(check, _WRAPPED_MARK, False):
            setattr(connector, CHECK_METHOD, _hinting(check))


def _hinting(check: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(check)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            check(self, *args, **kwargs)
        except ValueError as error:
            _add_hint(error, kwargs.get("strategy", args[0] if args else None))
            raise

    setattr(checked, _WRAPPED_MARK, True)
    return checked


def _add_hint(error: ValueError, strategy: Any) -> None:
    message = str(error.args[0]) if error.args else ""
    closest = closest_package_name(strategy) if isinstance(strategy, str) else None
    if closest is not None and message.startswith(UNKNOWN_NAME_ERROR):
        error.args = (f"{message} Did you mean {closest!r} (registered by lightning_hpz)?", *error.args[1:])
