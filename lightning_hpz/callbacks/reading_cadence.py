"""When a callback that keeps its per-step values on the device reads them on the host: at Lightning's logging steps.

Reading waits for the device, so the package's callbacks do it once per ``trainer.log_every_n_steps`` optimizer steps
and not on the steps between. ``log_every_n_steps=0`` (``Trainer(barebones=True)`` and logging off) still reads every
:data:`READ_EVERY_WITHOUT_LOGGING` steps, so values neither pile up on the device nor wait until the end.
"""

from __future__ import annotations

from lightning.pytorch import Trainer

READ_EVERY_WITHOUT_LOGGING = 50  # Lightning's default log_every_n_steps


def is_reading_step(trainer: Trainer) -> bool:
    """Whether the optimizer step that just ended is one at which the host reads what the device holds."""
    every = trainer.log_every_n_steps or READ_EVERY_WITHOUT_LOGGING
    return trainer.global_step % every == 0
