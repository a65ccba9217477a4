"""The processes a strategy trains in: DeepSpeed's ops and accelerator on CPU, the process groups, the copy ordering
installed for the run and undone at teardown, and the engine built with the strategy's config.

Lightning's ``DeepSpeedStrategy`` refuses any accelerator but CUDA in ``setup_environment``; on CPU its parent (DDP)
does the real work here, over gloo, after DeepSpeed has been told to use its CPU accelerator.
"""

from __future__ import annotations

import argparse
import functools
import logging
import warnings
from typing import Any, Optional

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_hpz import collectives, partitioning
from lightning_hpz.lifecycle import peer_watchdog
from lightning_hpz.lifecycle.run_exit import PEER_LOST_EXIT_CODE, exit_code_for_rank
from lightning_hpz.strategy.testing import CudaEvaluationContext

log = logging.getLogger(__name__)


class DeepSpeedEnvironment:
    """Mixin of :class:`~lightning_hpz.strategy.hpz_setup.HpzSetup`: set-up and teardown of the run's processes.

    Reads ``config``, ``hpz_sync``, ``emulate_async_copy``, ``hpz_partition_size``, ``peer_timeout`` and
    ``heartbeat_interval``; sets ``copy_ordering`` and, from set-up to teardown, ``peer_watchdog``. The
    autotuner is started, applied and ended through the hooks of
    :class:`~lightning_hpz.strategy.autotune_wiring.AutotuneWiring`.
    """

    # The Lightning DeepSpeedStrategy the concrete strategy extends: its parent's hooks are the ones without the
    # CUDA-only checks.
    _lightning_deepspeed_strategy: type
    copy_ordering: Optional[partitioning.CopyOrdering]
    peer_timeout: Optional[float]
    heartbeat_interval: float
    peer_watchdog: Optional[peer_watchdog.PeerWatchdog]
    committed_checkpoint: Optional[str]
    _cuda_evaluation: Optional[CudaEvaluationContext]

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
        self._start_peer_watchdog()
        self._start_autotune()
        if self.on_cpu:
            self._cuda_evaluation = CudaEvaluationContext.install_if_requested()
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
            if self._cuda_evaluation is not None:
                self._cuda_evaluation.uninstall()
            self._end_autotune()
            self._stop_peer_watchdog()

    def _start_peer_watchdog(self) -> None:
        # The process group exists now; every rank reaches this within seconds of the others (its init is a barrier).
        store = collectives.default_store()
        if self.peer_timeout is None or store is None or collectives.world_size() <= 1 or self.peer_watchdog:
            return
        devices_per_node = max(1, self.num_processes)  # Lightning numbers ranks node by node
        # A child of Lightning's launcher that exited 76 would get its node SIGKILLed (exit 137) while the launching
        # process still relays the loss; it exits 0, and the launching process (its node's leader) exits 76.
        lost_code = exit_code_for_rank(self, PEER_LOST_EXIT_CODE)
        self.peer_watchdog = peer_watchdog.PeerWatchdog(
            store,
            rank=collectives.rank(),
            world_size=collectives.world_size(),
            node_of=lambda rank: rank // devices_per_node,
            timeout=self.peer_timeout,
            interval=self.heartbeat_interval,
            checkpoint=lambda: self.committed_checkpoint,
            still_wanted=collectives.default_group_still_current(),  # Fabric and LitGPT never call teardown
            on_lost=functools.partial(peer_watchdog.exit_lost, code=lost_code),
        ).start()

    def _note_progress(self) -> None:
        """After a forward, a backward or an optimizer step: the watchdog counts it as a beat from every peer (a slow
        link that starves the heartbeats while training goes on is not a lost node; a step's three parts credited
        apart keep a slowed step's credits well inside the timeout). An optimizer step, and under ZeRO-3 every
        forward and backward, needs every rank; a ZeRO-1/2 forward does not, but a rank whose peer is gone blocks at
        its next reduction, so the credit delays a detection by one step at most."""
        if self.peer_watchdog is not None:
            self.peer_watchdog.note_progress()

    def _stop_peer_watchdog(self) -> None:
        watchdog, self.peer_watchdog = self.peer_watchdog, None
        if watchdog is not None:
            watchdog.stop()
            log.debug("slowest heartbeat round trip of this run: %.2f s", watchdog.slowest_round_trip)

    def init_deepspeed_distributed(self) -> None:
        super().init_deepspeed_distributed()
        self._check_secondary_groups_within_nodes()

    def _initialize_deepspeed(
        self, model: torch.nn.Module, optimizer: Any = None, lr_scheduler: Any = None
    ) -> tuple[Any, Any, Any, Any]:
        """``deepspeed.initialize`` with this strategy's config: (engine, optimizer, dataloader, scheduler)."""
        import deepspeed

        self._tune_engine(model)
        built = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._deepspeed_device_rank),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        self._training_engine_built()
        return built

    @property
    def _deepspeed_device_rank(self) -> int:
        # DeepSpeed compares the device rank with 0; a CPU device has no index, so the local rank stands in.
        return self.root_device.index if self.root_device.index is not None else self.local_rank

    def configure_activation_checkpointing(self) -> None:
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


def _use_deepspeed_cpu_accelerator() -> None:
    """Lightning trains on CPU: make DeepSpeed's accelerator agree, also on a machine that has a GPU."""
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if get_accelerator().device_name() != "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())


def _quiet_deepspeed_deprecations() -> None:
    # DeepSpeed's comm layer calls torch collectives that torch now marks deprecated, once per call: a flood of
    # warnings a user cannot act on.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
