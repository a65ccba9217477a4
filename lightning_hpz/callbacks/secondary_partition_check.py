"""``SecondaryPartitionCheck``: verify hpZ secondary partitions against their primaries every N training steps."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override


class SecondaryPartitionCheck(Callback):
    """Rebuild every parameter from its secondary and from its primary shards and raise if they differ.

    Runs between forward and backward, when the secondaries about to be read by the backward gathers exist, once per
    due optimizer step (its first micro-batch under gradient accumulation). A collective: every rank runs it at the
    same steps. Costs two extra gathers of the model, so pick ``every_n_steps``
    accordingly (a few hundred while validating a new cluster or DeepSpeed version).

    Args:
        every_n_steps: check when ``trainer.global_step`` is a multiple of this.
    """

    def __init__(self, every_n_steps: int = 100) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps} must be a positive number of steps.")
        self.every_n_steps = every_n_steps
        self.checks_run = 0
        self.last_checked = 0
        self._checked_at_step = -1

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        if trainer.global_step % self.every_n_steps or trainer.global_step == self._checked_at_step:
            return  # not due, or due and done at this step's first micro-batch (gradient accumulation)
        self._checked_at_step = trainer.global_step
        from lightning_hpz.partitioning import check_secondary_partitions  # needs DeepSpeed: only once it runs

        report = check_secondary_partitions(pl_module)
        self.checks_run += 1
        self.last_checked = report.checked
