"""A mistyped strategy name gets the closest name lightning_hpz registers, in Lightning's own error.

Lightning checks ``strategy=`` against its registry in the Trainer's (and Fabric's) connector, and its ValueError
lists a few of Lightning's own names only: ``Trainer(strategy="hpzz")`` says nothing of ``"hpz"``. That check is
wrapped once, when the names are registered: the same ValueError, with "Did you mean 'hpz'?" added when one of this
package's names is close. Every other error, and every valid name, passes through untouched.
"""

from __future__ import annotations

import difflib
from typing import Any, Optional

from lightning_hpz.strategy.presets import STRATEGY_PRESETS

UNKNOWN_NAME_ERROR = "You selected an invalid strategy name"


def closest_package_name(name: str) -> Optional[str]:
    """The name registered by lightning_hpz that ``name`` most likely meant, or None when none is close."""
    close = difflib.get_close_matches(name.lower(), [preset[0] for preset in STRATEGY_PRESETS], n=1, cutoff=0.6)
    return close[0] if close else None


def add_name_hints() -> None:
    """Wrap the Trainer's and Fabric's check of ``strategy=`` once (the check is Lightning-internal)."""
    from lightning_hpz import lightning_internals

    lightning_internals.add_strategy_name_hints(_add_hint)


def _add_hint(error: ValueError, strategy: Any) -> None:
    message = str(error.args[0]) if error.args else ""
    closest = closest_package_name(strategy) if isinstance(strategy, str) else None
    if closest is not None and message.startswith(UNKNOWN_NAME_ERROR):
        error.args = (f"{message} Did you mean {closest!r} (registered by lightning_hpz)?", *error.args[1:])
