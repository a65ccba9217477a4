"""``HpzSetup``: what stabilized hpZ adds to a Lightning DeepSpeed strategy, for the Trainer and for Fabric alike.

Lightning ships two ``DeepSpeedStrategy`` classes with the same hooks (``configure_launcher``, ``setup_environment``,
``init_deepspeed_distributed``, ``teardown``, ``register_strategies``; the private ones under the names
:mod:`lightning_hpz.lightning_internals` gives them): ``lightning.pytorch.strategies`` for the
Trainer and ``lightning.fabric.strategies`` for Fabric. :class:`HpzSetup` is mixed in front of either one and holds
everything that is not specific to the Trainer or to Fabric, one concern per mixin, each readable alone:

- :class:`~lightning_hpz.strategy.layout_checks.LayoutChecks`: devices per node, the hpZ size, layout refusals;
- :class:`~lightning_hpz.strategy.deepspeed_environment.DeepSpeedEnvironment`: CPU/gloo, process groups, copy
  ordering from set-up to teardown, the engine;
- :class:`~lightning_hpz.strategy.secondary_verification.SecondaryVerification`: refreshing and checking secondaries;
- :class:`~lightning_hpz.strategy.autotune_wiring.AutotuneWiring`: when the autotuner measures and what it sets.

This module holds the arguments (validated into the DeepSpeed config by :mod:`~lightning_hpz.strategy.config`) and
the registered names. :class:`~lightning_hpz.HpzStrategy` and :class:`~lightning_hpz.HpzFabricStrategy` only wire
it to their hooks.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any, Optional, Union

import torch

from lightning_hpz import partitioning
from lightning_hpz.autotune.memory_check import MemoryCheck
from lightning_hpz.lifecycle import peer_watchdog
from lightning_hpz.partitioning.ordering import SYNC_MODES
from lightning_hpz.strategy import config as cfg
from lightning_hpz.strategy.autotune_wiring import AutotuneWiring, build_autotuner
from lightning_hpz.strategy.deepspeed_environment import DeepSpeedEnvironment
from lightning_hpz.strategy.layout_checks import LayoutChecks
from lightning_hpz.strategy.presets import STRATEGY_PRESETS
from lightning_hpz.strategy.secondary_verification import SecondaryVerification


class HpzSetup(LayoutChecks, DeepSpeedEnvironment, SecondaryVerification, AutotuneWiring):
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
        peer_timeout: seconds without a heartbeat from a peer rank (or without an answer from the rendezvous store)
            after which this rank takes the peer's node as lost or the link to it as cut, prints which ranks on which
            node, and exits with code 76 instead of waiting for the process-group timeout (30 min). Beats go through
            the job's rendezvous store every ``heartbeat_interval`` seconds, beside training: a slow step, save or
            link does not stop them (see :mod:`lightning_hpz.lifecycle.peer_watchdog`). ``None`` turns it off.
            Default 45; at least three intervals.
        heartbeat_interval: seconds between heartbeats. Default 5.
        preset_name: the registered name this strategy was built from (``"zeropp"``, ...), which Lightning's registry
            passes; used in messages only.
        **kwargs: every other argument of Lightning's ``DeepSpeedStrategy`` (offload, buckets, activation
            checkpointing, ``logging_level``, ``timeout``, ...).
    """

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
        peer_timeout: Optional[float] = peer_watchdog.DEFAULT_TIMEOUT_S,
        heartbeat_interval: float = peer_watchdog.DEFAULT_INTERVAL_S,
        preset_name: Optional[str] = None,
        **kwargs: Any,
    ) -> None:
        if hpz_sync not in SYNC_MODES:
            raise cfg.HpzConfigurationError(f"hpz_sync={hpz_sync!r} is not a mode; choose one of {SYNC_MODES}.")
        peer_watchdog.check_settings(peer_timeout, heartbeat_interval)
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
        cfg.validate_checkpoint_writer(self.config)
        self.hpz_sync = hpz_sync
        self.emulate_async_copy = (
            partitioning.emulation_requested() if emulate_async_copy is None else emulate_async_copy
        )
        self.verify_after_load = verify_after_load
        self._autotuner = build_autotuner(
            autotune, autotune_memory_gib, self.zero_settings, hpz_partition_size, user_config
        )
        self.autotune_checkpoint = autotune_checkpoint
        self.hpz_partition_size: Optional[int] = None  # resolved once the cluster layout is known
        self.preset_name = preset_name
        self.peer_timeout = peer_timeout
        self.heartbeat_interval = heartbeat_interval
        self.peer_watchdog: Optional[peer_watchdog.PeerWatchdog] = None  # from set-up to teardown
        self.committed_checkpoint: Optional[str] = None  # the last checkpoint this run committed (named on a loss)
        self.copy_ordering: Optional[partitioning.CopyOrdering] = None
        self._cuda_evaluation = None  # Lightning's CUDA evaluation branch, emulated on CPU when asked for
        self._verify_at_next_step = False
        self.secondary_checks_run = 0
        self.autotune_memory_check: Optional[MemoryCheck] = None  # the peak through step 1 against the budget
        self._memory_check_pending = False  # set when a tuned training engine is built, until its check ran
        self._optimizer_stepped = False  # since that engine was built
        self._load_hook_modules: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()

    def lightning_config(self, config: Any) -> None:
        # Lightning's DeepSpeedStrategy.__init__ replaces its defaults by what this returns (config= or the
        # PL_DEEPSPEED_CONFIG_PATH file); this strategy merges that config over the defaults itself, in __init__.
        return None

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        # The entry is the class itself, as Lightning's registry contract has it (code reads the class from it);
        # the name travels as an argument, so that messages can say which registered name was asked for.
        for name, description, kwargs in STRATEGY_PRESETS:
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, preset_name=name, **kwargs)
