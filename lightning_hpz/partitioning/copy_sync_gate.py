"""Hold off DeepSpeed's own copy synchronize on one thread, never on the others.

DeepSpeed (PR #5216) ends ``Init._partition_param_sec`` with a host-blocking synchronize unless its accelerator's
``resolves_data_dependency()`` says True. While an ordering of this package handles a secondary copy, that synchronize
must be skipped; everywhere else (the gradient bucket path of ``stage3.py``, other threads running backward hooks)
DeepSpeed's stream waits must stay exactly as shipped.

So the accelerator's ``resolves_data_dependency`` is replaced once by a gate that answers True only on a thread that
is inside :func:`copy_sync_held_off`, and otherwise asks the original. Entering and leaving touches only a
``threading.local`` counter: nothing shared is saved or restored per call, so overlapping calls cannot leave the gate
open. :func:`remove_gates` puts the originals back (at teardown).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

_GATE_MARK = "_hpz_copy_sync_gate"
_thread_state = threading.local()
_gate_lock = threading.Lock()
_gated: list[Any] = []  # accelerator objects whose method is gated now


def held_off_on_this_thread() -> bool:
    return getattr(_thread_state, "depth", 0) > 0


def _is_gate(method: Any) -> bool:
    return getattr(method, _GATE_MARK, False)


def gate_accelerator(accelerator: Any) -> None:
    """Replace ``accelerator.resolves_data_dependency`` by the thread-local gate (idempotent, thread-safe)."""
    with _gate_lock:
        if _is_gate(getattr(accelerator, "resolves_data_dependency", None)):
            return
        shadowed = vars(accelerator).get("resolves_data_dependency")
        original = accelerator.resolves_data_dependency

        def resolves_data_dependency() -> bool:
            return True if held_off_on_this_thread() else original()

        setattr(resolves_data_dependency, _GATE_MARK, True)
        resolves_data_dependency.previous_instance_attribute = shadowed  # type: ignore[attr-defined]
        accelerator.resolves_data_dependency = resolves_data_dependency
        _gated.append(accelerator)


def remove_gates() -> None:
    """Give every gated accelerator its own ``resolves_data_dependency`` back."""
    with _gate_lock:
        while _gated:
            accelerator = _gated.pop()
            gate = vars(accelerator).get("resolves_data_dependency")
            if not _is_gate(gate):
                continue  # someone replaced it after us: leave theirs in place
            if gate.previous_instance_attribute is None:
                del accelerator.resolves_data_dependency
            else:
                accelerator.resolves_data_dependency = gate.previous_instance_attribute


@contextlib.contextmanager
def copy_sync_held_off(accelerator: Any) -> Iterator[None]:
    """Inside the block, and only on the calling thread, ``accelerator`` reports that copies need no synchronize."""
    gate_accelerator(accelerator)
    _thread_state.depth = getattr(_thread_state, "depth", 0) + 1
    try:
        yield
    finally:
        _thread_state.depth -= 1
