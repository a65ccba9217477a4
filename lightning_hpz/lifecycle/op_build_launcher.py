"""Lightning's script launcher, preceded by the one-time build of the ops DeepSpeed JIT-compiles for this run.

The ops (the CPU communication op on CPU, ``cpu_adam`` when the optimizer is offloaded) are built or loaded in the
launching process before it starts the other ranks, so each build runs once, announced and timed, instead of in
every rank at once with nothing printed; a stale build lock is cleared first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_hpz.lightning_internals import SubprocessScriptLauncher


# Lightning's launcher that re-executes the script once per extra rank (what DDP/DeepSpeed use by default)
class OpsBuiltFirstLauncher(SubprocessScriptLauncher):
    def __init__(self, *args: Any, prepare_ops: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prepare_ops = prepare_ops

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if not self.cluster_environment.creates_processes_externally:  # this process starts the other ranks
            self.prepare_ops()
        return super().launch(function, *args, trainer=trainer, **kwargs)
