"""The Trainer strategy's launcher: the ops built once before the other ranks start (``OpsBuiltFirstLauncher``), and
the Trainer's checkpoint connector extended while the entry point runs, since the entry point resolves ``ckpt_path``
before anything else of the strategy is called (``checkpointing/resume_by_name.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_hpz.checkpointing import resume_by_name
from lightning_hpz.lifecycle.op_build_launcher import OpsBuiltFirstLauncher


class TrainerLauncher(OpsBuiltFirstLauncher):
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if trainer is None:
            return super().launch(function, *args, **kwargs)
        with resume_by_name.connector_installed(trainer):
            return super().launch(function, *args, trainer=trainer, **kwargs)
