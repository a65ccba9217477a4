"""``HpzFabricStrategy``: Fabric's DeepSpeed strategy with stabilized hierarchical partitioning (hpZ), CPU and GPU."""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY, DeepSpeedStrategy
from lightning.fabric.utilities.seed import reset_seed
from typing_extensions import override

from lightning_hpz import partitioning
from lightning_hpz.strategy.hpz_setup import HpzSetup


class HpzFabricStrategy(HpzSetup, DeepSpeedStrategy):
    """ZeRO stages 1-3 with stabilized hpZ for Fabric, registered as ``Fabric(strategy="hpz")`` (and ``zero3``, ...).

    Takes every argument of :class:`~lightning_hpz.strategy.hpz_setup.HpzSetup` (``stage``, ``hpz_partition_size``,
    ``quantized_weights``, ``quantized_gradients``, ``hpz_sync``, ``emulate_async_copy``, ``verify_after_load``,
    ``config``) and of Fabric's :class:`~lightning.fabric.strategies.DeepSpeedStrategy`, with the same defaults,
    checks and messages as the Trainer's :class:`~lightning_hpz.HpzStrategy`.

    In a training loop, ``fabric.strategy.check_secondary_partitions()`` (between forward and backward, on every
    rank) verifies the secondary partitions and ``fabric.strategy.refresh_secondary_partitions()`` drops them after
    you write sharded weights yourself. ``fabric.load`` refreshes them and, with ``verify_after_load``, checks them at
    the next ``fabric.backward``. Call ``fabric.strategy.teardown()`` when done: Fabric never calls it itself, and
    it undoes what setup installed in DeepSpeed.
    """

    # Fabric internals relied on (lightning/fabric/strategies/deepspeed.py, connector.py; Lightning 2.6): the connector
    # calls `_configure_launcher` before launch; `_setup_distributed`, `_init_deepspeed_distributed`,
    # `_initialize_engine`, `_format_config`/`_config_initialized` and `_deepspeed_engine` are overridden or read.
    _lightning_deepspeed_strategy = DeepSpeedStrategy

    @override
    def _setup_distributed(self) -> None:
        if not self.on_cpu:
            super()._setup_distributed()
            return
        # Fabric's own (lightning/fabric/strategies/deepspeed.py) first validates device indices, which a CPU device
        # does not have; the rest is the same.
        reset_seed()
        self._set_world_ranks()
        self._init_deepspeed_distributed()
        if not self._config_initialized:
            self._format_config()
            self._config_initialized = True

    @override
    def _initialize_engine(
        self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, scheduler: Any = None
    ) -> tuple[Any, Any, Any]:
        # A scheduler the loop hands to `fabric.setup` stays the loop's to step, as under every Fabric strategy: the
        # engine, which `optimizer.step()` steps (see `optimizer_step`), would step it a second time. The engine keeps
        # only a scheduler built from the DeepSpeed config.
        engine, deepspeed_optimizer, _, deepspeed_scheduler = self._initialize_deepspeed(model, optimizer, None)
        if scheduler is not None:
            deepspeed_scheduler = scheduler
        if self.zero_stage_3:
            partitioning.order_converted_parameters(model)  # converted by a zero.Init outside fabric.init_module
        self._watch_load_state_dict(model)
        return engine, deepspeed_optimizer, deepspeed_scheduler

    @override
    def module_sharded_context(self) -> Any:
        self._tune_structure(None)  # zero.Init builds parameters with the hpZ size it finds; the model is not known yet
        return super().module_sharded_context()

    @override
    def _hpz_module(self) -> torch.nn.Module:
        if self._deepspeed_engine is None:
            raise RuntimeError(
                "HpzFabricStrategy has no model yet: call `fabric.setup(model, optimizer)` before checking or "
                "refreshing secondary partitions."
            )
        return self._deepspeed_engine.module

    @override
    def backward(self, tensor: torch.Tensor, module: Optional[torch.nn.Module], *args: Any, **kwargs: Any) -> None:
        self._verify_if_due()
        self._check_memory_if_due()
        super().backward(tensor, module, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(self._stepped_through_engine(optimizer, kwargs), **kwargs)
        self._note_optimizer_step()
        return output

    def _stepped_through_engine(self, optimizer: Any, kwargs: dict[str, Any]) -> Any:
        """The engine, when Fabric hands over the engine's own optimizer (it does: Fabric's ``_FabricOptimizer`` steps
        the engine only when the engine passes its ``Optimizable`` check, which DeepSpeed's does not).

        Stepping the ZeRO optimizer directly skips what ``DeepSpeedEngine.step()`` does around it: the scheduler of
        the DeepSpeed config, the global step and sample counters (checkpoints record them), the accumulation
        boundary and what happens there, the monitor. A closure (``step(closure)``) keeps Fabric's own path: the
        engine's ``step()`` takes none.
        """
        engine = self._deepspeed_engine
        if engine is None or "closure" in kwargs or optimizer is not getattr(engine, "optimizer", None):
            return optimizer
        return engine

    @override
    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: Optional[bool] = None
    ) -> dict[str, Any]:
        remainder = super().load_checkpoint(path, state=state, strict=strict, weights_only=weights_only)
        if self._deepspeed_engine is not None:
            self._after_weights_changed()
        return remainder


def register() -> None:
    HpzFabricStrategy.register_strategies(STRATEGY_REGISTRY)


# Importing the strategy registers its names with Fabric; lightning_hpz.strategy.registration imports it with Lightning.
register()
