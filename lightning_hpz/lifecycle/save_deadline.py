"""Warn once when a checkpoint save takes longer than a preempted job is given to save it.

A scheduler that preempts sends SIGTERM (or the ``--signal`` of ``sbatch``) and kills the job a grace period later:
SLURM's ``KillWait`` and torchrun's both default to 30 s. A preemption checkpoint that takes longer is killed half
written (the previous checkpoint stays, see ``checkpointing/commit.py``), the job ends with 137 and is never requeued.
Each save is timed; the first one over the grace gets a warning with both numbers and the fixes.
"""

from __future__ import annotations

import os
from typing import Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

GRACE_ENV_VAR = "LIGHTNING_HPZ_PREEMPTION_GRACE"
DEFAULT_GRACE_SECONDS = 30.0  # SLURM KillWait and torchrun's termination timeout


def grace_seconds() -> float:
    """Seconds between the preemption signal and the kill, as the user declared them, else the schedulers' default."""
    value = os.environ.get(GRACE_ENV_VAR)
    try:
        return float(value) if value else DEFAULT_GRACE_SECONDS
    except ValueError:
        raise ValueError(f"{GRACE_ENV_VAR}={value!r} is not a number of seconds.") from None


class SaveDeadline:
    """Times saves; warns at the first one a preemption would not leave time for."""

    def __init__(self, grace: Optional[float] = None) -> None:
        self.grace = grace_seconds() if grace is None else grace
        self.warned = False

    def observe(self, seconds: float) -> bool:
        """Record one save's duration; whether this call warned."""
        if self.warned or seconds <= self.grace:
            return False
        self.warned = True
        rank_zero_warn(
            f"Saving a checkpoint took {seconds:.0f} s, longer than the {self.grace:.0f} s a preempted job gets "
            "between the signal and the kill: a preemption checkpoint would be killed half written, and the job "
            "would not be requeued. Ask for the signal earlier (sbatch --signal=USR1@<seconds>, at least the save "
            f"time plus one step) and set {GRACE_ENV_VAR} to that offset, or raise the scheduler's grace (SLURM "
            "KillWait, Kubernetes terminationGracePeriodSeconds)."
        )
        return True
