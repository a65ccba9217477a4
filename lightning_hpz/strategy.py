"""``HpzStrategy``: Lightning's DeepSpeed strategy with stabilized hierarchical partitioning (hpZ), on CPU and GPU."""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.signal_connector import _get_sigkill_signal
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_hpz.hpz_setup import HpzSetup
from lightning_hpz.resumable_loader import ResumableLoader

log = logging.getLogger(__name__)


class HpzStrategy(HpzSetup, DeepSpeedStrategy):
    """ZeRO stages 1-3 with stabilized hierarchical partitioning (hpZ), registered as ``strategy="hpz"``.

    Takes every argument of :class:`~lightning_hpz.hpz_setup.HpzSetup` (``stage``, ``hpz_partition_size``,
    ``quantized_weights``, ``quantized_gradients``, ``hpz_sync``, ``emulate_async_copy``, ``verify_after_load``,
    ``config``) and of Lightning's :class:`~lightning.pytorch.strategies.DeepSpeedStrategy`, plus:

    Args:
        exact_resume: make a resume from a mid-epoch checkpoint continue with the very batches the interrupted run
            would have seen next (Lightning otherwise restarts the epoch for a plain DataLoader). Default True.
    """

    strategy_name = "hpz"
    _lightning_deepspeed_strategy = DeepSpeedStrategy

    def __init__(self, *, exact_resume: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.exact_resume = exact_resume

    # ----------------------------------------------------------------------------------------------- environment
    @override
    def setup_distributed(self) -> None:
        if not self.on_cpu:
            super().setup_distributed()
            return
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()  # Lightning's own also validates device indices, which a CPU device does not have
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    @override
    def _setup_model_and_optimizer(
        self, model: torch.nn.Module, optimizer: Any, lr_scheduler: Any = None
    ) -> tuple[Any, Any]:
        engine, deepspeed_optimizer, _, _ = self._initialize_deepspeed(model, optimizer, lr_scheduler)
        return engine, deepspeed_optimizer

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if (
            not self.exact_resume
            or trainer is None
            or trainer.state.fn != TrainerFn.FITTING
            or isinstance(dataloader, _Stateful)
            or not hasattr(dataloader, "__len__")
        ):
            return dataloader
        progress = trainer.fit_loop.epoch_loop.batch_progress
        return ResumableLoader(dataloader, batches_consumed=lambda: progress.current.processed)

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        # Lightning's launcher only reaps its children when one of them fails; a failure on rank 0 would leave them
        # blocked in a collective until the process-group timeout. End them now.
        if isinstance(self.launcher, _SubprocessScriptLauncher) and getattr(self.launcher, "procs", None):
            self.launcher.kill(_get_sigkill_signal())

    # ----------------------------------------------------------------------------------------------- secondaries
    @override
    def _hpz_module(self) -> torch.nn.Module:
        assert self.lightning_module is not None
        return self.lightning_module

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        self._verify_if_due()
        return output

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        self._after_weights_changed()
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        self._after_weights_changed()

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        self._watch_load_state_dict(self._hpz_module())


def register() -> None:
    HpzStrategy.register_strategies(StrategyRegistry)
