"""Preemption: a signal only sets a flag; the ranks agree at the next step boundary, checkpoint, and exit.

Schedulers announce a preemption with SIGTERM (SLURM, Kubernetes, docker, systemd) or with SIGUSR1 (SLURM's
``--signal``). Lightning 2.6 answers SIGTERM with a broadcast *inside* the signal handler
(``lightning/pytorch/trainer/connectors/signal_connector.py``, ``_sigterm_notifier_fn``): while the other ranks sit in
a ZeRO-3 all-gather, that broadcast pairs with the wrong collective and the job deadlocks or ends silently. Here the
handler does nothing but record the signal; the decision is an ordinary all-reduce at a step boundary, where every
rank issues the same collectives in the same order.
"""

from __future__ import annotations

import signal
import threading
from typing import Any, Optional

# sysexits.h EX_TEMPFAIL: "a temporary failure; the user is invited to retry". A preempted run exits with this code
# after its checkpoint is committed, so a job script can tell "resume me" from success (0) and from a crash.
PREEMPTED_EXIT_CODE = 75

DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")


class TrainingPreempted(SystemExit):
    """Training stopped on a preemption signal after committing a resumable checkpoint."""

    def __init__(self, message: str, checkpoint: str, code: int = PREEMPTED_EXIT_CODE) -> None:
        super().__init__(code)
        self.message = message
        self.checkpoint = checkpoint

    def __str__(self) -> str:
        return self.message


class PreemptionSignals:
    """Records that one of ``signals`` arrived; installs and restores the handlers (main thread only)."""

    def __init__(self, signals: tuple[str, ...] = DEFAULT_SIGNALS) -> None:
        self.signals = tuple(_signal_number(name) for name in signals)
        self.received: Optional[int] = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        # Python runs handlers in the main thread only, and refuses to install them from another one.
        if threading.current_thread() is not threading.main_thread() or self._previous:
            return
        for signum in self.signals:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._record)

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def _record(self, signum: int, frame: Any) -> None:
        # Only a flag: no collective, no I/O. Async-signal safe in the sense that matters here.
        self.received = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else ""


def _signal_number(name: str) -> int:
    number = getattr(signal, name, None)
    if not isinstance(number, int):
        raise ValueError(f"preemption signal {name!r} is not a signal on this platform; use names like 'SIGTERM'.")
    return int(number)
