"""How a run ends on purpose before ``max_steps``: exit codes, the exception every rank raises together, signals.

Preemption: a signal only sets a flag; the ranks agree at the next step boundary, checkpoint, and exit.

Schedulers announce a preemption with SIGTERM (SLURM, Kubernetes, docker, systemd) or with SIGUSR1 (SLURM's
``--signal``). Lightning 2.6 answers SIGTERM with a broadcast *inside* the signal handler
(``lightning/pytorch/trainer/connectors/signal_connector.py``, ``_sigterm_notifier_fn``): while the other ranks sit in
a ZeRO-3 all-gather, that broadcast pairs with the wrong collective and the job deadlocks or ends silently. Here the
handler does nothing but record the signal; the decision is an ordinary all-reduce at a step boundary, where every
rank issues the same collectives in the same order.
"""

from __future__ import annotations

import atexit
import signal
import subprocess
import threading
from typing import Any, Optional

from lightning.fabric.plugins.environments import LightningEnvironment

# sysexits.h EX_TEMPFAIL: "a temporary failure; the user is invited to retry". A preempted run exits with this code
# after its checkpoint is committed, so a job script can tell "resume me" from success (0) and from a crash.
PREEMPTED_EXIT_CODE = 75
# LossStabilityMonitor(action="stop") ended the run: a checkpoint before the instability exists, but resuming as is
# would likely meet it again (lower the learning rate, skip the data, or roll back).
UNSTABLE_EXIT_CODE = 3
# Training ran no optimizer step although steps were asked for (no batches, or a data set smaller than one batch).
NOTHING_TRAINED_EXIT_CODE = 4
# Preempted before this run had anything new to save: during set-up, checkpoint load, the sanity check, before the
# first optimizer step, or in `validate`/`test`/`predict`. 128 + SIGTERM, the code a shell reports for a process that
# SIGTERM ended, because the meaning is the same: the run stopped on a signal and left no checkpoint of its own (a
# resume starts where the previous one did). A job script that requeues on 75 requeues on 143 too; the difference
# tells whether the interrupted attempt advanced anything.
PREEMPTED_NOTHING_SAVED_EXIT_CODE = 143
# A peer rank or the rendezvous store fell silent (a lost node or a cut link: lifecycle/peer_watchdog.py); sysexits.h
# EX_PROTOCOL, "remote error". The last committed checkpoint is intact; resume from it once every node is back.
PEER_LOST_EXIT_CODE = 76

DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")


class CoordinatedExit(SystemExit):
    """Every rank leaves ``fit`` together, by the same decision, after the same collectives: nobody is blocked.

    The exit code is the run's reason (see the ``*_EXIT_CODE`` constants). Ranks that Lightning's own launcher
    started exit 0 instead: its child observer SIGKILLs the whole job, the launching process included, as soon as a
    child exits non-zero, so the launching process carries the code for its node (and waits for those ranks at exit).
    """

    status = "ended"

    def __init__(self, message: str, trainer: Any, code: int, checkpoint: Optional[str] = None) -> None:
        super().__init__(exit_code_for_rank(trainer.strategy, code))
        self.message = message
        self.checkpoint = checkpoint
        self.run_code = code
        _wait_at_exit_for_launched_ranks(trainer)

    def __str__(self) -> str:
        return self.message


class TrainingPreempted(CoordinatedExit):
    """Training stopped on a preemption signal after committing a resumable checkpoint (exit code 75)."""

    status = "preempted"

    def __init__(self, message: str, trainer: Any, checkpoint: str) -> None:
        super().__init__(message, trainer, PREEMPTED_EXIT_CODE, checkpoint)


class PreemptedWithoutCheckpoint(CoordinatedExit):
    """A preemption signal arrived before this run had trained anything new, or outside training (exit code 143)."""

    status = "preempted"

    def __init__(self, message: str, trainer: Any) -> None:
        super().__init__(message, trainer, PREEMPTED_NOTHING_SAVED_EXIT_CODE)


class TrainingStopped(CoordinatedExit):
    """``LossStabilityMonitor(action="stop")`` ended training at an instability (exit code 3)."""

    status = "stopped"

    def __init__(self, message: str, trainer: Any, checkpoint: Optional[str]) -> None:
        super().__init__(message, trainer, UNSTABLE_EXIT_CODE, checkpoint)


def exit_code_for_rank(strategy: Any, code: int) -> int:
    """``code``, or 0 on a rank that Lightning's launcher started (its launching process reports for the node)."""
    return 0 if started_by_lightning_launcher(strategy) else code


def started_by_lightning_launcher(strategy: Any) -> bool:
    """Whether this rank is a child of Lightning's own launcher (Trainer or Fabric), whose child observer SIGKILLs the
    node's processes, the launching one included, within seconds of a child exiting non-zero: such a rank must exit
    0 and leave the node's exit code to the launching process."""
    environment = getattr(strategy, "cluster_environment", None)  # single-device strategies have none
    return isinstance(environment, LightningEnvironment) and getattr(strategy, "local_rank", 0) > 0


def _wait_at_exit_for_launched_ranks(trainer: Any, timeout: float = 120.0) -> None:
    # At interpreter exit, not now: the user's code after `fit` may still run collectives with those ranks.
    processes = list(getattr(trainer.strategy.launcher, "procs", None) or [])

    def wait() -> None:
        for process in processes:
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()

    if processes:
        atexit.register(wait)


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
        self.received = None  # a new window: a signal recorded in an earlier, finished run is not this run's
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
