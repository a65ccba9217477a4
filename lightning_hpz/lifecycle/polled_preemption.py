"""Preemption for loops the package does not run (Fabric): the loop asks, every rank at the same point, and decides.

Fabric 2.6 installs no SIGTERM/SIGUSR1 handler: the default action ends the signalled rank at once, and its peers
wait in their next collective (a ZeRO-3 all-gather) until the process-group timeout. ``HpzFabricStrategy`` records
the signals from ``setup_environment`` to ``teardown`` instead; the loop calls ``fabric.strategy.
preemption_requested()`` on every rank at the same point (after ``optimizer.step()``, say), which is one all-reduce
of the flags on the default process group: every rank gets the same answer, nobody is left waiting. Under NCCL that
one number waits for the step's queued GPU work (as reading the loss does); no side group, no extra connection.

A loop that never asks would otherwise never hear the signal: until the first ``preemption_requested()`` call, a
signal does what it did before set-up (ends the process, or runs the handler that was there).
"""

from __future__ import annotations

import signal
from typing import Any

from lightning_hpz import collectives
from lightning_hpz.lifecycle.run_exit import DEFAULT_SIGNALS, PreemptionSignals


class PolledPreemption(PreemptionSignals):
    """Records SIGTERM/SIGUSR1 once a loop has asked for them; :meth:`requested` agrees across ranks."""

    def __init__(self, signals: tuple[str, ...] = DEFAULT_SIGNALS) -> None:
        super().__init__(signals)
        self.polled = False

    def requested(self) -> bool:
        """Whether any rank was signalled. A collective: call it on every rank at the same point of the loop."""
        self.polled = True
        flag = float(self.received is not None)
        return bool(collectives.all_reduce_values([flag], op="max")[0])

    def _record(self, signum: int, frame: Any) -> None:
        super()._record(signum, frame)
        if not self.polled:  # nobody will ask: let the signal do what it did before set-up
            self.uninstall()
            signal.raise_signal(signum)
