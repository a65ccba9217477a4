"""``HpzStrategy``: Lightning's DeepSpeed strategy with stabilized hierarchical partitioning (hpZ), on CPU and GPU."""

from __future__ import annotations

import argparse
import contextlib
import logging
import warnings
from collections.abc import Generator
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.signal_connector import _get_sigkill_signal
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_hpz import collectives, partitioning
from lightning_hpz import config as cfg
from lightning_hpz.partitioning.ordering import SYNC_MODES
from lightning_hpz.resumable_loader import ResumableLoader

log = logging.getLogger(__name__)


class HpzStrategy(DeepSpeedStrategy):
    """ZeRO stages 1-3 with stabilized hierarchical partitioning (hpZ), registered as ``strategy="hpz"``.

    Args:
        stage: ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also parameters. Default 3.
        hpz_partition_size: ranks a parameter's secondary copy is sharded over after forward, so that the backward
            all-gather stays inside a node. ``"auto"`` (default) uses the devices per node on a multi-node run and
            turns hpZ off (1) on a single node. Must divide the devices per node. Stage 3 only.
        quantized_weights: qwZ, int8 forward all-gather of weights. CUDA only (DeepSpeed has no CPU kernels).
        quantized_gradients: qgZ, quantized hierarchical gradient reduction. CUDA only.
        hpz_sync: how a secondary-partition copy is ordered before the all-gather that reads it. ``"event"``
            (default): the gathering stream waits on an event recorded after the copy, no host stall.
            ``"stream"``: the host synchronizes the compute stream after each copy (DeepSpeed PR #5216).
            ``"none"``: nothing, the racy pre-fix order; only to reproduce arXiv 2407.01614.
        emulate_async_copy: CPU only: make secondary copies land late, with poisoned memory until something orders
            after them, to reproduce the race without a GPU. Default: the ``LIGHTNING_HPZ_EMULATE_ASYNC_COPY``
            environment variable.
        verify_after_load: after loading a checkpoint or a state dict, check at the next training step that every
            secondary partition matches its primary partitions, and raise if not. Default True.
        exact_resume: make a resume from a mid-epoch checkpoint continue with the very batches the interrupted run
            would have seen next (Lightning otherwise restarts the epoch for a plain DataLoader). Default True.
        config: a DeepSpeed config dict or JSON path, merged over the strategy's defaults (nested sections key by
            key); a value given both here and as one of the arguments above must agree.
        **kwargs: every other :class:`~lightning.pytorch.strategies.DeepSpeedStrategy` argument (offload, buckets,
            activation checkpointing, ``logging_level``, ``timeout``, ...).
    """

    strategy_name = "hpz"

    def __init__(
        self,
        stage: Optional[int] = None,
        hpz_partition_size: Union[int, str, None] = None,
        quantized_weights: Optional[bool] = None,
        quantized_gradients: Optional[bool] = None,
        hpz_sync: str = "event",
        emulate_async_copy: Optional[bool] = None,
        verify_after_load: bool = True,
        exact_resume: bool = True,
        config: Union[dict[str, Any], str, Path, None] = None,
        **kwargs: Any,
    ) -> None:
        if hpz_sync not in SYNC_MODES:
            raise cfg.HpzConfigurationError(f"hpz_sync={hpz_sync!r} is not a mode; choose one of {SYNC_MODES}.")
        user_config = cfg.load_user_config(config)
        explicit = dict(
            stage=stage,
            hpz_partition_size=hpz_partition_size,
            quantized_weights=quantized_weights,
            quantized_gradients=quantized_gradients,
        )
        self.zero_settings = cfg.resolve_zero_settings(explicit, user_config)
        cfg.validate_settings(self.zero_settings)
        super().__init__(stage=self.zero_settings.stage, config=None, **kwargs)
        self.config = cfg.merge_configs(self.config, user_config)
        self.hpz_sync = hpz_sync
        self.emulate_async_copy = (
            partitioning.emulation_requested() if emulate_async_copy is None else emulate_async_copy
        )
        self.verify_after_load = verify_after_load
        self.exact_resume = exact_resume
        self.hpz_partition_size: Optional[int] = None  # resolved once the cluster layout is known
        self.copy_ordering: Optional[partitioning.CopyOrdering] = None
        self._verify_at_next_step = False
        self.secondary_checks_run = 0
        self._load_hook_module: Optional[torch.nn.Module] = None

    # ----------------------------------------------------------------------------------------------- layout
    @property
    def devices_per_node(self) -> int:
        return len(self.parallel_devices or []) or 1

    @override
    def _configure_launcher(self) -> None:
        # Called while the Trainer is built, before any process is launched: the place for every layout check.
        self._resolve_layout()
        super()._configure_launcher()

    def _resolve_layout(self) -> None:
        settings = self.zero_settings
        size, how = cfg.resolve_partition_size(
            settings.hpz_partition_size, settings.stage, self.devices_per_node, self.num_nodes
        )
        cfg.validate_layout(size, self.devices_per_node, self.num_nodes)
        self._refuse_quantization_without_cuda()
        if self.emulate_async_copy and not isinstance(self.accelerator, CPUAccelerator):
            raise cfg.HpzConfigurationError(
                "emulate_async_copy=True reproduces the hpZ race on CPU; on a GPU the copies really are asynchronous. "
                "Use accelerator='cpu', or unset LIGHTNING_HPZ_EMULATE_ASYNC_COPY."
            )
        self.hpz_partition_size = size
        self.config.setdefault("zero_optimization", {}).update(cfg.zero_section(settings, size))
        if settings.hpz_partition_size == "auto":
            rank_zero_info(how)

    def _refuse_quantization_without_cuda(self) -> None:
        if isinstance(self.accelerator, CUDAAccelerator) or self.accelerator is None:
            return
        for name in ("quantized_weights", "quantized_gradients"):
            if getattr(self.zero_settings, name):
                raise cfg.HpzConfigurationError(
                    f"{name}=True (ZeRO++ {'qwZ' if name == 'quantized_weights' else 'qgZ'}) needs CUDA: DeepSpeed has "
                    f"no {type(self.accelerator).__name__} kernels for it. Set {name}=False, or train on GPUs."
                )

    # ----------------------------------------------------------------------------------------------- environment
    @property
    def on_cpu(self) -> bool:
        return isinstance(self.accelerator, CPUAccelerator)

    @override
    def setup_environment(self) -> None:
        _quiet_deepspeed_deprecations()
        if self.on_cpu:
            _use_deepspeed_cpu_accelerator()
            DDPStrategy.setup_environment(self)  # Lightning's DeepSpeedStrategy refuses anything but CUDA here
        else:
            super().setup_environment()
        # Scoped to this strategy: wrapped from here to teardown (also after an exception), DeepSpeed as shipped after.
        self.copy_ordering = partitioning.install(self.hpz_sync, emulate_async_copy=self.emulate_async_copy)
        if self.hpz_sync == "none" and (self.hpz_partition_size or 1) > 1:
            rank_zero_warn(
                "hpz_sync='none' leaves the hpZ secondary-partition copy unordered before its all-gather: training "
                "can silently diverge (arXiv 2407.01614). Use it only to reproduce that failure."
            )

    @override
    def setup_distributed(self) -> None:
        if not self.on_cpu:
            super().setup_distributed()
            return
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    @override
    def _init_deepspeed_distributed(self) -> None:
        super()._init_deepspeed_distributed()
        self._check_secondary_groups_within_nodes()

    def _check_secondary_groups_within_nodes(self) -> None:
        """DeepSpeed groups consecutive global ranks; make sure the launcher numbered each node's ranks together."""
        size = self.hpz_partition_size or 1
        if size <= 1:
            return
        node_of_rank = collectives.all_gather_object(self.node_rank)
        for start in range(0, self.world_size, size):
            nodes = set(node_of_rank[start : start + size])
            if len(nodes) > 1:
                raise cfg.HpzConfigurationError(
                    f"hpZ secondary group of ranks {start}..{start + size - 1} spans nodes {sorted(nodes)}: the "
                    "launcher did not number each node's ranks consecutively, so backward gathers would cross nodes. "
                    "Launch with ranks grouped by node (torchrun and SLURM do), or set hpz_partition_size=1."
                )

    @override
    def _setup_model_and_optimizer(
        self, model: torch.nn.Module, optimizer: Any, lr_scheduler: Any = None
    ) -> tuple[Any, Any]:
        import deepspeed

        # DeepSpeed compares the device rank with 0; a CPU device has no index, so the local rank stands in.
        device_rank = self.root_device.index if self.root_device.index is not None else self.local_rank
        engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=device_rank),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
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
    def refresh_secondary_partitions(self) -> int:
        """Drop every secondary partition so the next gather rebuilds them from the primary shards."""
        assert self.lightning_module is not None
        return partitioning.refresh_secondary_partitions(self.lightning_module)

    def check_secondary_partitions(self, raise_on_mismatch: bool = True) -> partitioning.SecondaryCheckReport:
        """Compare every secondary partition with its primaries on all ranks (a collective)."""
        assert self.lightning_module is not None
        self.secondary_checks_run += 1
        return partitioning.check_secondary_partitions(self.lightning_module, raise_on_mismatch=raise_on_mismatch)

    def _after_weights_changed(self) -> None:
        if self.zero_stage_3 and (self.hpz_partition_size or 1) > 1:
            self.refresh_secondary_partitions()
            self._verify_at_next_step = self.verify_after_load

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        if self._verify_at_next_step:
            # Forward has just rebuilt the secondaries from the loaded weights; backward will read them.
            self._verify_at_next_step = False
            self.check_secondary_partitions()
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
    @contextlib.contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        with super().model_sharded_context():
            yield
        # `configure_model` may have written weights into the shards: no secondary copy may keep the old values.
        if self.zero_stage_3 and self.lightning_module is not None:
            partitioning.refresh_secondary_partitions(self.lightning_module)

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        assert self.lightning_module is not None
        if self.zero_stage_3:
            partitioning.order_converted_parameters(self.lightning_module)  # converted by a zero.Init before setup
        # A user's `load_state_dict` into the sharded model (inside GatheredParameters, often on one rank only) must
        # not leave stale copies: drop those of the gathered parameters, their release rebuilds them on every rank.
        if self._load_hook_module is not self.lightning_module:
            self.lightning_module.register_load_state_dict_post_hook(_drop_secondaries_of_gathered_parameters)
            self._load_hook_module = self.lightning_module

    @override
    def teardown(self) -> None:
        # Lightning's Trainer calls teardown after every fit/validate/test/predict, also when one raised.
        try:
            super().teardown()
        finally:
            if self.copy_ordering is not None:
                partitioning.uninstall(self.copy_ordering)

    # ----------------------------------------------------------------------------------------------- registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, description, kwargs in STRATEGY_PRESETS:
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, **kwargs)


STRATEGY_PRESETS: list[tuple[str, str, dict[str, Any]]] = [
    ("hpz", "ZeRO-3 + hpZ (secondary partition = devices per node), stabilized; CPU and GPU", {}),
    (
        "hpz_offload",
        "ZeRO-3 + hpZ with optimizer states offloaded to CPU memory",
        {"offload_optimizer": True},
    ),
    (
        "zeropp",
        "full ZeRO++: ZeRO-3 + hpZ + qwZ (int8 weight gather) + qgZ (quantized gradients); CUDA only",
        {"quantized_weights": True, "quantized_gradients": True},
    ),
    ("zero1", "ZeRO stage 1 (optimizer states sharded); CPU and GPU", {"stage": 1, "hpz_partition_size": 1}),
    (
        "zero2",
        "ZeRO stage 2 (optimizer states + gradients sharded); CPU and GPU",
        {"stage": 2, "hpz_partition_size": 1},
    ),
    (
        "zero2_offload",
        "ZeRO stage 2 with optimizer states offloaded to CPU",
        {"stage": 2, "hpz_partition_size": 1, "offload_optimizer": True},
    ),
    ("zero3", "plain ZeRO stage 3 (everything sharded, hpZ off); CPU and GPU", {"stage": 3, "hpz_partition_size": 1}),
    (
        "zero3_offload",
        "plain ZeRO stage 3 with parameters and optimizer states offloaded to CPU",
        {"stage": 3, "hpz_partition_size": 1, "offload_optimizer": True, "offload_parameters": True},
    ),
]


def _use_deepspeed_cpu_accelerator() -> None:
    """Lightning trains on CPU: make DeepSpeed's accelerator agree, also on a machine that has a GPU."""
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if get_accelerator().device_name() != "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())


def _drop_secondaries_of_gathered_parameters(module: torch.nn.Module, incompatible_keys: Any) -> None:
    partitioning.refresh_secondary_partitions(module, gathered_only=True)


def _quiet_deepspeed_deprecations() -> None:
    # DeepSpeed's comm layer calls torch collectives that torch now marks deprecated, once per call: a flood of
    # warnings a user cannot act on.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)


def register() -> None:
    HpzStrategy.register_strategies(StrategyRegistry)
