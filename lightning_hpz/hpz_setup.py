"""``HpzSetup``: what stabilized hpZ adds to a Lightning DeepSpeed strategy, for the Trainer and for Fabric alike.

Lightning ships two ``DeepSpeedStrategy`` classes with the same hooks (``_configure_launcher``, ``setup_environment``,
``_init_deepspeed_distributed``, ``teardown``, ``register_strategies``): ``lightning.pytorch.strategies`` for the
Trainer and ``lightning.fabric.strategies`` for Fabric. :class:`HpzSetup` is mixed in front of either one and holds
everything that is not specific to the Trainer or to Fabric: config resolution and validation, the layout checks,
CPU/gloo support and the partitioning layer (copy ordering, emulation, secondary-partition check and refresh).
:class:`~lightning_hpz.HpzStrategy` and :class:`~lightning_hpz.fabric.HpzFabricStrategy` only wire it to their hooks.
"""

from __future__ import annotations

import argparse
import warnings
import weakref
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_hpz import collectives, partitioning
from lightning_hpz import config as cfg
from lightning_hpz.autotune.memory_check import MemoryCheck, check_memory
from lightning_hpz.autotune.tuner import Autotuner, fixed_settings
from lightning_hpz.partitioning.ordering import SYNC_MODES
from lightning_hpz.planning.communication import ClusterLayout
from lightning_hpz.planning.tuning_decision import TuningDecision
from lightning_hpz.strategy_presets import STRATEGY_PRESETS


class HpzSetup:
    """ZeRO stages 1-3 with stabilized hierarchical partitioning (hpZ) on top of a Lightning ``DeepSpeedStrategy``.

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
        autotune: ``True``: measure the links once the processes are up and choose the hpZ size and the ZeRO-3
            thresholds (``stage3_max_live_parameters``, ``stage3_max_reuse_distance``, ``stage3_prefetch_bucket_size``,
            ``stage3_param_persistence_threshold``) you left unset, from the planner's predictions (one table in the
            log; ``strategy.autotune_decision``). A resume re-uses the choice recorded in the checkpoint;
            ``"retune"`` measures anew. Stage 3 only. Default False.
        autotune_memory_gib: the memory budget per rank the tuner's choice must fit (80% of it; the rest is left for
            activations). Default: the device's memory (CPU: the host's, shared by the node's ranks). After the
            first optimizer step the real peak is compared with it, logged, and warned about when above it
            (``strategy.autotune_memory_check``).
        autotune_checkpoint: the checkpoint whose recorded choice to re-use (the Trainer finds the one it resumes
            itself; Fabric users pass the directory given to ``fabric.load``).
        config: a DeepSpeed config dict or JSON path (default: the file named by ``PL_DEEPSPEED_CONFIG_PATH``, as in
            Lightning), merged over the strategy's defaults (nested sections key by key); a value given both here and
            as one of the arguments above must agree.
        **kwargs: every other argument of Lightning's ``DeepSpeedStrategy`` (offload, buckets, activation
            checkpointing, ``logging_level``, ``timeout``, ...).
    """

    # The Lightning DeepSpeedStrategy the concrete strategy extends: its parent's hooks are the ones without the
    # CUDA-only checks.
    _lightning_deepspeed_strategy: type

    def __init__(
        self,
        stage: int = cfg.DEFAULT_STAGE,
        hpz_partition_size: Union[int, str, None] = None,
        quantized_weights: Optional[bool] = None,
        quantized_gradients: Optional[bool] = None,
        hpz_sync: str = "event",
        emulate_async_copy: Optional[bool] = None,
        verify_after_load: bool = True,
        autotune: Union[bool, str] = False,
        autotune_memory_gib: Optional[float] = None,
        autotune_checkpoint: Union[str, Path, None] = None,
        config: Union[dict[str, Any], str, Path, None] = None,
        **kwargs: Any,
    ) -> None:
        if hpz_sync not in SYNC_MODES:
            raise cfg.HpzConfigurationError(f"hpz_sync={hpz_sync!r} is not a mode; choose one of {SYNC_MODES}.")
        user_config = cfg.load_user_config(*cfg.user_config_source(config))
        explicit = dict(
            stage=stage,
            hpz_partition_size=hpz_partition_size,
            quantized_weights=quantized_weights,
            quantized_gradients=quantized_gradients,
        )
        self.zero_settings = cfg.resolve_zero_settings(explicit, user_config, kwargs.get("zero_optimization", True))
        cfg.validate_settings(self.zero_settings)
        super().__init__(stage=self.zero_settings.stage, config=None, **kwargs)
        self.config = cfg.merge_configs(self.config, user_config)
        cfg.validate_activation_checkpointing(self.config)
        self.hpz_sync = hpz_sync
        self.emulate_async_copy = (
            partitioning.emulation_requested() if emulate_async_copy is None else emulate_async_copy
        )
        self.verify_after_load = verify_after_load
        self._autotuner = _autotuner(autotune, autotune_memory_gib, self.zero_settings, hpz_partition_size, user_config)
        self.autotune_checkpoint = autotune_checkpoint
        self.hpz_partition_size: Optional[int] = None  # resolved once the cluster layout is known
        self.preset_name: Optional[str] = None  # the registered name it was built from, for messages
        self.copy_ordering: Optional[partitioning.CopyOrdering] = None
        self._verify_at_next_step = False
        self.secondary_checks_run = 0
        self.autotune_memory_check: Optional[MemoryCheck] = None  # the peak through step 1 against the budget
        self._memory_check_pending = False  # set when a tuned training engine is built, until its check ran
        self._optimizer_stepped = False  # since that engine was built
        self._load_hook_modules: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()

    def _load_config(self, config: Any) -> None:
        # Lightning's DeepSpeedStrategy.__init__ replaces its defaults by what this returns (config= or the
        # PL_DEEPSPEED_CONFIG_PATH file); this strategy merges that config over the defaults itself, in __init__.
        return None

    def _set_deepspeed_activation_checkpointing(self) -> None:
        # Lightning's version leaves out the layer count and the boundary sync: contiguous checkpointing then fails.
        import deepspeed

        section = self.config.get("activation_checkpointing")
        if section:
            deepspeed.checkpointing.configure(
                mpu_=None,
                partition_activations=section.get("partition_activations"),
                contiguous_checkpointing=section.get("contiguous_memory_optimization"),
                num_checkpoints=section.get("number_checkpoints"),
                checkpoint_in_cpu=section.get("cpu_checkpointing"),
                synchronize=section.get("synchronize_checkpoint_boundary"),
                profile=section.get("profile"),
            )

    # ----------------------------------------------------------------------------------------------- layout
    @property
    def devices_per_node(self) -> int:
        return len(self.parallel_devices or []) or 1

    @property
    def on_cpu(self) -> bool:
        return self._device_type() == "cpu"

    def _device_type(self) -> Optional[str]:
        # The Trainer and Fabric have distinct accelerator classes; the devices they hand the strategy say the same.
        devices = self.parallel_devices
        return devices[0].type if devices else None

    @property
    def needs_deepspeed_ops(self) -> bool:
        """Whether DeepSpeed will JIT-compile an op for this run: its CPU communication op, or ``cpu_adam``."""
        return self.on_cpu or partitioning.offloads_to_cpu_adam(self.config)

    def prepare_deepspeed_ops(self) -> None:
        """Build or load those ops in this process, once per machine, announced, never waiting on a stale lock."""
        if self.on_cpu:
            partitioning.prepare_cpu_comm_op()
        if partitioning.offloads_to_cpu_adam(self.config):
            partitioning.prepare_cpu_adam_op()

    def _configure_launcher(self) -> None:
        # Called while the Trainer or Fabric is built, before any process is launched: the place for every layout check.
        self._resolve_layout()
        super()._configure_launcher()

    def _resolve_layout(self) -> None:
        settings = self.zero_settings
        size, how = cfg.resolve_partition_size(
            settings.hpz_partition_size, settings.stage, self.devices_per_node, self.num_nodes
        )
        cfg.validate_layout(size, self.devices_per_node, self.num_nodes)
        self._refuse_quantization_without_cuda()
        if self.emulate_async_copy and not self.on_cpu:
            raise cfg.HpzConfigurationError(
                "emulate_async_copy=True reproduces the hpZ race on CPU; on a GPU the copies really are asynchronous. "
                "Use accelerator='cpu', or unset LIGHTNING_HPZ_EMULATE_ASYNC_COPY."
            )
        self.hpz_partition_size = size
        if settings.stage:  # stage 0 (zero_optimization=False) keeps ZeRO off, as in Lightning
            self.config.setdefault("zero_optimization", {}).update(cfg.zero_section(settings, size))
        if self._autotuner is not None and self._autotuner.fixed.hpz_partition_size is None:
            rank_zero_info("hpZ partition size: chosen by the autotuner once the processes are up (autotune=True).")
        elif settings.hpz_partition_size == "auto":
            rank_zero_info(how)

    def _refuse_quantization_without_cuda(self) -> None:
        if self._device_type() in (None, "cuda"):
            return
        if self.preset_name == "zeropp":
            raise cfg.HpzConfigurationError(
                "strategy='zeropp' (full ZeRO++: hpZ + qwZ + qgZ) needs CUDA: DeepSpeed has no "
                f"{type(self.accelerator).__name__} kernels for its quantized communication. Use strategy='hpz' "
                "(ZeRO-3 + hpZ, no quantization) here, or train on GPUs."
            )
        for name in ("quantized_weights", "quantized_gradients"):
            if getattr(self.zero_settings, name):
                raise cfg.HpzConfigurationError(
                    f"{name}=True (ZeRO++ {'qwZ' if name == 'quantized_weights' else 'qgZ'}) needs CUDA: DeepSpeed has "
                    f"no {type(self.accelerator).__name__} kernels for it. Set {name}=False, or train on GPUs."
                )

    # ----------------------------------------------------------------------------------------------- environment
    def setup_environment(self) -> None:
        _quiet_deepspeed_deprecations()
        if self.on_cpu:
            _use_deepspeed_cpu_accelerator()  # before any DeepSpeed op is built or loaded
        self.prepare_deepspeed_ops()  # a quick load where the launcher built them; torchrun-started ranks need it
        if self.on_cpu:
            # Lightning's DeepSpeedStrategy refuses anything but CUDA here; its parent (DDP) does the real work.
            super(self._lightning_deepspeed_strategy, self).setup_environment()
        else:
            super().setup_environment()
        if self._autotuner is not None and self._autotune_wanted():
            self._autotuner.start(self._layout(), self._autotune_resume_path())
            if self._autotuner.decision is not None:  # re-used from the checkpoint: known before anything is built
                self._apply_autotune(self._autotuner.decision)
        # Scoped to this strategy: wrapped from here to teardown (also after an exception), DeepSpeed as shipped after.
        self.copy_ordering = partitioning.install(self.hpz_sync, emulate_async_copy=self.emulate_async_copy)
        if self.hpz_sync == "none" and (self.hpz_partition_size or 1) > 1:
            rank_zero_warn(
                "hpz_sync='none' leaves the hpZ secondary-partition copy unordered before its all-gather: training "
                "can silently diverge (arXiv 2407.01614). Use it only to reproduce that failure."
            )

    def teardown(self) -> None:
        # The Trainer calls teardown after every fit/validate/test/predict, also when one raised; Fabric users call it.
        try:
            super().teardown()
        finally:
            if self.copy_ordering is not None:
                partitioning.uninstall(self.copy_ordering)
            if self._autotuner is not None:
                self._autotuner.end_of_run()

    def _init_deepspeed_distributed(self) -> None:
        super()._init_deepspeed_distributed()
        self._check_secondary_groups_within_nodes()

    def _check_secondary_groups_within_nodes(self) -> None:
        """DeepSpeed groups consecutive global ranks; make sure the launcher numbered each node's ranks together."""
        size = self.hpz_partition_size or 1
        if size <= 1:
            return
        node_of_rank = collectives.all_gather_object(self.node_rank)
        for start in range(0, len(node_of_rank), size):
            nodes = set(node_of_rank[start : start + size])
            if len(nodes) > 1:
                raise cfg.HpzConfigurationError(
                    f"hpZ secondary group of ranks {start}..{start + size - 1} spans nodes {sorted(nodes)}: the "
                    "launcher did not number each node's ranks consecutively, so backward gathers would cross nodes. "
                    "Launch with ranks grouped by node (torchrun and SLURM do), or set hpz_partition_size=1."
                )

    # ----------------------------------------------------------------------------------------------- autotune
    @property
    def autotune_decision(self) -> Optional[TuningDecision]:
        """What the autotuner chose (None without ``autotune``, or before the engine is built)."""
        return self._autotuner.decision if self._autotuner is not None else None

    def _layout(self) -> ClusterLayout:
        return ClusterLayout(self.num_nodes, self.devices_per_node)

    def _autotune_resume_path(self) -> Union[str, Path, None]:
        return self.autotune_checkpoint

    def _autotune_wanted(self) -> bool:
        """Whether this run builds a training engine (the Trainer's validate/test/predict do not)."""
        return True

    def _tune_structure(self, module: Optional[torch.nn.Module]) -> None:
        """Before a ``zero.Init`` converts parameters: fix the hpZ size they are made with."""
        if self._autotuner is None or not self._autotune_wanted():
            return
        size = self._autotuner.decide_structure(module or torch.nn.Module(), self._layout(), self.config)
        self._apply_zero_keys({"zero_hpz_partition_size": size})

    def _apply_autotune(self, decision: TuningDecision) -> None:
        self._apply_zero_keys(decision.zero_section(spelled_as=self.config.get("zero_optimization")))

    def _apply_zero_keys(self, keys: dict[str, Any]) -> None:
        size = int(keys.get("zero_hpz_partition_size", self.hpz_partition_size or 1))
        cfg.validate_layout(size, self.devices_per_node, self.num_nodes)
        self.config.setdefault("zero_optimization", {}).update(keys)
        changed = size != (self.hpz_partition_size or 1)
        self.hpz_partition_size = size
        if changed:
            self._check_secondary_groups_within_nodes()

    def _initialize_deepspeed(
        self, model: torch.nn.Module, optimizer: Any = None, lr_scheduler: Any = None
    ) -> tuple[Any, Any, Any, Any]:
        """``deepspeed.initialize`` with this strategy's config: (engine, optimizer, dataloader, scheduler)."""
        import deepspeed

        if self._autotuner is not None:
            self._apply_autotune(self._autotuner.decide(model, self._layout(), self.config))

        built = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._deepspeed_device_rank),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        self._memory_check_pending = self.autotune_decision is not None
        self._optimizer_stepped = False
        return built

    @property
    def _deepspeed_device_rank(self) -> int:
        # DeepSpeed compares the device rank with 0; a CPU device has no index, so the local rank stands in.
        return self.root_device.index if self.root_device.index is not None else self.local_rank

    # ----------------------------------------------------------------------------------------------- secondaries
    def _hpz_module(self) -> torch.nn.Module:
        """The user's model whose secondary partitions the strategy checks and refreshes."""
        raise NotImplementedError

    def refresh_secondary_partitions(self) -> int:
        """Drop every secondary partition so the next gather rebuilds them from the primary shards."""
        return partitioning.refresh_secondary_partitions(self._hpz_module())

    def check_secondary_partitions(self, raise_on_mismatch: bool = True) -> partitioning.SecondaryCheckReport:
        """Compare every secondary partition with its primaries on all ranks (a collective)."""
        self.secondary_checks_run += 1
        return partitioning.check_secondary_partitions(self._hpz_module(), raise_on_mismatch=raise_on_mismatch)

    def _after_weights_changed(self) -> None:
        if self.zero_stage_3 and (self.hpz_partition_size or 1) > 1:
            self.refresh_secondary_partitions()
            self._verify_at_next_step = self.verify_after_load

    def _note_optimizer_step(self) -> None:
        """Call after every optimizer step of the strategy: the memory check waits for this run's first one."""
        self._optimizer_stepped = True

    def _check_memory_if_due(self) -> None:
        """Once per engine, at the first step after this run's first optimizer step: the peak against the budget."""
        if not (self._memory_check_pending and self._optimizer_stepped and self.autotune_decision is not None):
            return
        self._memory_check_pending = False
        # A collective: every rank reaches its first step after an optimizer step together.
        self.autotune_memory_check = check = check_memory(self.autotune_decision, self.root_device)
        (rank_zero_info if check.within_budget else rank_zero_warn)(check.message())

    def _verify_if_due(self) -> None:
        """Call between forward and backward: forward has just rebuilt the secondaries that backward will read."""
        if self._verify_at_next_step:
            self._verify_at_next_step = False
            self.check_secondary_partitions()

    def _watch_load_state_dict(self, module: torch.nn.Module) -> None:
        # A user's `load_state_dict` into the sharded model (inside GatheredParameters, often on one rank only) must
        # not leave stale copies: drop those of the gathered parameters, their release rebuilds them on every rank.
        if module not in self._load_hook_modules:
            module.register_load_state_dict_post_hook(_drop_secondaries_of_gathered_parameters)
            self._load_hook_modules.add(module)

    # ----------------------------------------------------------------------------------------------- registry
    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, description, kwargs in STRATEGY_PRESETS:
            if name not in strategy_registry:
                strategy_registry.register(name, _built_as(cls, name), description=description, **kwargs)


def _built_as(cls: type, preset_name: str) -> Any:
    """What the registry calls for a name: the strategy, remembering the name so messages can use it."""

    def build(**kwargs: Any) -> Any:
        strategy = cls(**kwargs)
        strategy.preset_name = preset_name
        return strategy

    return build


def _autotuner(
    mode: Union[bool, str], memory_gib: Optional[float], settings: Any, hpz_partition_size: Any, user_config: dict
) -> Optional[Autotuner]:
    if mode is False:
        return None
    if settings.stage != 3:
        raise cfg.HpzConfigurationError(
            f"autotune={mode!r} chooses the hpZ size and ZeRO-3's thresholds, so it needs stage=3 (stage="
            f"{settings.stage}). Use stage=3, or autotune=False."
        )
    try:
        return Autotuner(mode, memory_gib, fixed_settings(hpz_partition_size, user_config))
    except ValueError as err:
        raise cfg.HpzConfigurationError(str(err)) from err


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
