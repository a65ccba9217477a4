"""Whether ``lightning-hpz fit`` trained anything, also when it resumed: a run that took no optimizer step exits 4.

``trainer.global_step`` after a resume counts the interrupted run's steps too, so it cannot tell a resumed run that
trained from one that resumed at its end. :class:`StepAtTrainStart` keeps the step the run started from.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from lightning.pytorch import Callback, Trainer

from lightning_hpz.lifecycle.run_exit import NOTHING_TRAINED_EXIT_CODE, exit_code_for_rank


class StepAtTrainStart(Callback):
    """The global step when training started (after any checkpoint was restored); None if it never started."""

    def __init__(self) -> None:
        self.step: Optional[int] = None

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.step = trainer.global_step


def refuse_run_that_trained_nothing(trainer: Trainer, start: Optional[StepAtTrainStart] = None) -> None:
    """A fit that ran no optimizer step although steps were asked for ends with exit code 4, saying why."""
    if 0 in (trainer.max_steps, trainer.max_epochs, trainer.limit_train_batches):
        return
    started = start.step if start is not None else 0
    if started is not None and trainer.global_step > started:
        return
    if trainer.global_step > 0:
        message = (
            f"Nothing was trained: the run resumed at step {trainer.global_step} and fit ended there (max_steps="
            f"{trainer.max_steps}, max_epochs={trainer.max_epochs}). Raise max_steps or max_epochs to train on, or "
            "start without ckpt_path."
        )
    else:
        message = (
            f"Nothing was trained: fit ended after 0 optimizer steps (max_steps={trainer.max_steps}, "
            f"{trainer.num_training_batches} training batches per epoch on each rank). Check that the data has at "
            "least one global batch (batch size x devices x nodes x accumulate_grad_batches) and that "
            "limit_train_batches > 0."
        )
    if trainer.is_global_zero:
        print(message, file=sys.stderr)
    raise SystemExit(exit_code_for_rank(trainer.strategy, NOTHING_TRAINED_EXIT_CODE))
