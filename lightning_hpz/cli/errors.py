"""What ``lightning-hpz fit`` prints when a run cannot start: the cause, last, in one line, instead of a traceback.

jsonargparse wraps an error raised while it builds the model, data or strategy in its own, and adds every Union
subtype it tried: dozens of lines around the one that says what is wrong. The package's own message (and the hint
for a mistyped strategy name) is dug out of the exception chain and printed alone.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterator
from typing import Optional

# What lightning_hpz raises for a bad setting, path or name: errors a user fixes in the command or config.
BAD_INPUT_ERRORS = (ValueError, LookupError, OSError, ImportError)
LIGHTNING_UNKNOWN_STRATEGY = re.compile(r"invalid strategy name: `strategy='([^']*)'`")
# jsonargparse lists, per Union subtype it tried, the error as text only ("Errors:\n  - ...\n  - ...")
UNION_ERRORS = re.compile(r"^Errors:\n((?:  - .*\n?)+)", re.MULTILINE)
UNION_TYPE_MISMATCH = ("Expected a ", "Not a valid ", "Type <", "Import path ")


def user_facing_message(error: BaseException) -> Optional[str]:
    """The message to print instead of the traceback, or None when the error is not a bad input we can name."""
    chain = list(exception_chain(error))
    for link in chain:  # the package's own exception, where jsonargparse kept it as the cause
        if type(link).__module__.startswith("lightning_hpz.") and isinstance(link, BAD_INPUT_ERRORS):
            return f"{type(link).__name__}: {link}"
    for link in chain:  # else its message, which jsonargparse only kept as text
        unknown = LIGHTNING_UNKNOWN_STRATEGY.search(str(link))
        if unknown:
            return unknown_strategy_message(unknown.group(1))
        reasons = union_failure_reasons(str(link))
        if reasons:
            return " ".join(reasons)
    return None


def union_failure_reasons(message: str) -> list[str]:
    """From jsonargparse's Union error, the reasons that are not just "this value is not of that subtype"."""
    listed = UNION_ERRORS.search(message)
    if listed is None:
        return []
    reasons = [line.removeprefix("  - ").strip() for line in listed.group(1).splitlines()]
    return [reason for reason in reasons if reason and not reason.startswith(UNION_TYPE_MISMATCH)]


def exception_chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: Optional[BaseException] = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def unknown_strategy_message(name: str) -> str:
    from lightning.pytorch.strategies import StrategyRegistry

    known = StrategyRegistry.available_strategies()
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return (
        f"strategy={name!r} is not a registered strategy name.{hint} "
        "`lightning-hpz strategies` lists the names lightning_hpz adds; Lightning's own include 'ddp' and 'deepspeed'."
    )
