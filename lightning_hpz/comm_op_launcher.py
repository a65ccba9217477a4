"""Lightning's script launcher, preceded by the one-time build of DeepSpeed's CPU communication op.

The op is built (or loaded) in the launching process before it starts the other ranks, so the build runs once,
announced and timed, instead of in every rank at once with nothing printed; a stale build lock is cleared first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Lightning internal: the launcher that re-executes the script once per extra rank (what DDP/DeepSpeed use by default)
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

from lightning_hpz.partitioning import prepare_cpu_comm_op


class CommOpFirstLauncher(_SubprocessScriptLauncher):
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if not self.cluster_environment.creates_processes_externally:  # this process starts the other ranks
            prepare_cpu_comm_op()
        return super().launch(function, *args, trainer=trainer, **kwargs)
