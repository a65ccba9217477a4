"""``HpzStrategy``: Lightning's DeepSpeed strategy with stabilized hierarchical partitioning (hpZ), on CPU and GPU."""

from __future__ import annotations

import argparse
import contextlib
import logging
import threading
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_hpz import collectives, lightning_internals, partitioning
from lightning_hpz.checkpointing import commit, compatibility, resume, resume_by_name
from lightning_hpz.checkpointing.errors import CheckpointRefusedError, CheckpointStorageError
from lightning_hpz.checkpointing.preemption_retention import (
    DEFAULT_KEEP,
    is_preemption_checkpoint,
    retire_older_preemption_checkpoints,
)
from lightning_hpz.checkpointing.rank_agreement import agreed
from lightning_hpz.exact_resume import data_order, epoch_end_checkpoint, random_layers, stream_position
from lightning_hpz.exact_resume.data_order import DataOrderError
from lightning_hpz.exact_resume.resumable_batches import ResumableBatches
from lightning_hpz.exact_resume.resumable_loader import ResumableLoader
from lightning_hpz.lifecycle import rank_failure
from lightning_hpz.lifecycle.preemption_checkpoint import PreemptionCheckpoint
from lightning_hpz.lifecycle.run_exit import CoordinatedExit
from lightning_hpz.lifecycle.save_deadline import SaveDeadline
from lightning_hpz.lightning_internals import (
    SubprocessScriptLauncher,
    TrainerDeepSpeedHooks,
    attached_trainer,
    script_launcher_procs,
    weights_only_argument,
)
from lightning_hpz.models.computed_buffers import recompute_buffers_in_float32
from lightning_hpz.strategy.hpz_setup import HpzSetup
from lightning_hpz.strategy.inference_config import inference_config
from lightning_hpz.strategy.trainer_launcher import TrainerLauncher

log = logging.getLogger(__name__)
_RESUMABLE = (ResumableBatches, ResumableLoader)


class HpzStrategy(HpzSetup, TrainerDeepSpeedHooks):
    """ZeRO stages 1-3 with stabilized hierarchical partitioning (hpZ), registered as ``strategy="hpz"``.

    Takes every argument of :class:`~lightning_hpz.strategy.hpz_setup.HpzSetup` (``stage``, ``hpz_partition_size``,
    ``quantized_weights``, ``quantized_gradients``, ``hpz_sync``, ``emulate_async_copy``, ``verify_after_load``,
    ``peer_timeout``, ``heartbeat_interval``, ``config``)
    and of Lightning's :class:`~lightning.pytorch.strategies.DeepSpeedStrategy`, plus:

    Args:
        handle_preemption: on SIGTERM or SIGUSR1 (what schedulers send before they preempt), from strategy set-up to
            teardown in ``fit``, ``validate``, ``test`` and ``predict``: commit a checkpoint at the next optimizer step
            and exit with code 75, resumable; or, when this run has trained nothing to save (set-up, checkpoint load,
            sanity check, evaluation-only runs), exit with code 143 without one (adds a
            :class:`~lightning_hpz.callbacks.PreemptionCheckpoint` unless the Trainer has one). Default True.
        exact_resume: make a resume from a mid-epoch checkpoint continue with the very batches the interrupted run
            would have seen next (Lightning otherwise restarts the epoch for a plain DataLoader; a ``Stateful``
            ``IterableDataset`` or loader is put back at its position, each rank at its own), and refuse a resume
            whose data order cannot repeat (``DataOrderError``), that would have to read a stream without a position
            again to reach a mid-epoch one (``DataOrderError``), or that changes the number of ranks. Training data
            that no mid-epoch resume could continue exactly (a ``RandomSampler``, an ``IterableDataset`` that is not
            ``Stateful``) is refused when ``fit`` starts, before the first step. False: all are
            warned about, such a stream is read again up to the position, and a resume on another number of ranks
            continues at the same global sample position. Default True.
        failure_grace_period: when the Trainer raises on a rank, that rank aborts its process groups and every rank
            runs its own ``except`` code; ranks of the launching node that neither reached their own error handling
            nor exited this many seconds later are taken as blocked in a collective and killed. Default 30.
    """

    strategy_name = "hpz"
    _lightning_deepspeed_strategy = DeepSpeedStrategy

    def __init__(
        self,
        *,
        exact_resume: bool = True,
        failure_grace_period: float = rank_failure.DEFAULT_GRACE_PERIOD_S,
        handle_preemption: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.exact_resume = exact_resume
        self._save_deadline = SaveDeadline()
        self.failure_grace_period = failure_grace_period
        self._resumed_data_order: Optional[dict[str, Any]] = None  # set by a checkpoint load, checked on the data
        self.handle_preemption = handle_preemption
        self._peer_watch: Optional[threading.Thread] = None  # after a failure: this node's other ranks, until teardown
        self._preemption: Optional[PreemptionCheckpoint] = None  # holds the signal handlers from set-up to teardown

    @override
    def configure_launcher(self) -> None:
        super().configure_launcher()
        # Build the ops DeepSpeed JIT-compiles once, visibly, before the other ranks start (op_build_launcher); choose
        # a checkpoint resumed by name once every rank has started (resume_by_name). Lightning's launcher runs every
        # entry point, also in processes started externally (torchrun, srun), where it starts no other rank.
        if type(self.launcher) is SubprocessScriptLauncher:
            self.replace_launcher(
                TrainerLauncher(
                    self.cluster_environment, self.num_processes, self.num_nodes, prepare_ops=self.prepare_deepspeed_ops
                )
            )

    # ----------------------------------------------------------------------------------------------- environment
    @override
    def setup_environment(self) -> None:
        # First thing in `Trainer._run`, before the process group, the checkpoint load and every loop: from here to
        # teardown a preemption signal is only recorded, and the ranks agree on it at points all of them reach
        # (PreemptionCheckpoint). Lightning's handler, which broadcasts inside the signal handler, is never installed.
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self.handle_preemption and trainer is not None:
            self._preemption = self._preemption_callback(trainer)
            self._preemption.open_window(trainer)
        super().setup_environment()

    def _preemption_callback(self, trainer: Any) -> PreemptionCheckpoint:
        callback = next((c for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint)), None)
        if callback is None:
            callback = PreemptionCheckpoint()
            trainer.callbacks.append(callback)
        return callback

    @override
    def setup_distributed(self) -> None:
        if self.on_cpu:
            from lightning.fabric.utilities.seed import reset_seed

            reset_seed()  # Lightning's own also validates device indices, which a CPU device does not have
            self.set_world_ranks()
            self.init_deepspeed_distributed()
        else:
            super().setup_distributed()
        # The first moment the ranks can agree on a checkpoint resumed by name: before the autotuner reads it and
        # before it is loaded (checkpointing/resume_by_name.py).
        trainer = attached_trainer(self.lightning_module)
        if trainer is not None:
            resume_by_name.choose(trainer)

    @override
    def setup_model_and_optimizer(
        self, model: torch.nn.Module, optimizer: Any, lr_scheduler: Any = None
    ) -> tuple[Any, Any]:
        engine, deepspeed_optimizer, _, _ = self._initialize_deepspeed(model, optimizer, lr_scheduler)
        return engine, deepspeed_optimizer

    @override
    def initialize_inference_engine(self, model: torch.nn.Module) -> None:
        # Replaces Lightning's inference engine build, which passes the device index (None on CPU), and its engine
        # cannot be built for hpZ by DeepSpeed 0.19.8 (see partitioning/inference_engine.py).
        import deepspeed
        from lightning.pytorch.strategies.deepspeed import remove_module_hooks

        if self.zero_stage_3:
            partitioning.ensure_hpz_groups(self.hpz_partition_size or 1)
        remove_module_hooks(model)  # as Lightning does: the engine registers its own hooks
        self.model, _, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._deepspeed_device_rank),
            config=inference_config(self.config),
            model=model,
            optimizer=None,
            lr_scheduler=None,
            model_parameters=[],
            dist_init_required=False,
        )

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        # the package's own batches resume by position already, with the same state on every rank; a user's Stateful
        # loader is wrapped, so that its position is taken after the last trained batch on each rank (stream_position)
        if trainer is None or trainer.state.fn != TrainerFn.FITTING or isinstance(dataloader, _RESUMABLE):
            return dataloader
        if trainer.training:
            # Lightning creates the iterator before it sets the epoch being resumed (`_FitLoop.setup_data`, then
            # `on_advance_start`): a loader that draws its order at once (workers, a skip) would use epoch 0's.
            data_order.set_epoch_before_iteration(dataloader, trainer.fit_loop.epoch_progress.current.processed)
            self._refuse_data_that_cannot_resume(dataloader)
            self._check_resumed_data_order(dataloader)
        # wrapped under either setting: a checkpoint holds the wrapper's state, which Lightning refuses to load into a
        # loader without one (so exact_resume could not be switched off for a resume on another number of ranks)
        progress = trainer.fit_loop.epoch_loop.batch_progress
        return ResumableLoader(
            dataloader,
            lambda: progress.current.processed,
            world_size=self.world_size,
            rank=self.global_rank,
            exact=self.exact_resume,
        )

    def _refuse_data_that_cannot_resume(self, dataloader: Any) -> None:
        # at the first start, not at the resume after a preemption hours later; agreed, so that every rank raises
        if self.exact_resume:
            data_order.refuse_set_up_that_cannot_resume(agreed(data_order.problems_known_at_start(dataloader)))

    def _check_resumed_data_order(self, dataloader: Any) -> None:
        if self._resumed_data_order is not None:
            saved, self._resumed_data_order = self._resumed_data_order, None
            data_order.check_resumed_order(saved, dataloader, exact=self.exact_resume)

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        if isinstance(exception, (CoordinatedExit, CheckpointRefusedError, CheckpointStorageError, DataOrderError)):
            return  # every rank raises this itself, after the same collectives: nobody is blocked, each one reports
        if self.peer_watchdog is not None and isinstance(exception, RuntimeError):
            # a collective that failed because a node is gone: name the node (exit 76) rather than a closed socket
            self.peer_watchdog.confirm_peers_alive()
        # Peers would wait for this rank in their next collective until the timeout: release them (rank_failure.py).
        # The children of Lightning's subprocess launcher (its `procs`) still stuck after the grace period are killed.
        children = script_launcher_procs(self.launcher)
        self._peer_watch = rank_failure.release_peers(children, self.failure_grace_period)

    @override
    def teardown(self) -> None:
        # Lightning tears down after on_exception: the watch of this node's other ranks ends with the Trainer's run,
        # as soon as each has left its collectives or exited (or was killed, stuck, after the grace period), so no
        # thread of this package outlives the Trainer call.
        try:
            super().teardown()
        finally:
            preemption, self._preemption = self._preemption, None
            if preemption is not None:  # the handlers in place before set-up are back
                preemption.close_window()
            commit.finish_saves()  # the checkpoint folders this run claimed are free for the next job
            watch, self._peer_watch = self._peer_watch, None
            if watch is not None:
                watch.join()

    @override
    def _autotune_wanted(self) -> bool:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return trainer is None or trainer.state.fn == TrainerFn.FITTING

    @override
    def _autotune_resume_path(self) -> Optional[Any]:
        if self.autotune_checkpoint is not None or self.lightning_module is None:
            return self.autotune_checkpoint
        # the path `fit` resolved, before the Trainer stores it: the autotuner re-uses the choice recorded there
        return resume_by_name.chosen_path(lightning_internals.resolved_ckpt_path(self.lightning_module.trainer))

    # ----------------------------------------------------------------------------------------------- secondaries
    @override
    def _hpz_module(self) -> torch.nn.Module:
        assert self.lightning_module is not None
        return self.lightning_module

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        self._note_progress()
        self._verify_if_due()
        self._check_memory_if_due()
        return output

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        output = super().backward(closure_loss, optimizer, *args, **kwargs)
        self._note_progress()
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().validation_step(*args, **kwargs)
        self._note_progress()
        return output

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().test_step(*args, **kwargs)
        self._note_progress()
        return output

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().predict_step(*args, **kwargs)
        self._note_progress()
        return output

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._note_optimizer_step()
        self._note_progress()
        return output

    @override
    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Optional[Any] = None) -> None:
        filepath = self.broadcast(filepath)
        stream_position.keep_rank_positions(checkpoint, self.global_rank, collectives.gather_object)
        step, epoch = checkpoint.get("global_step"), checkpoint.get("epoch")
        run = compatibility.describe_run(self, self.lightning_module, self.model, step, epoch)
        started = time.monotonic()
        with commit.committed_save(Path(filepath), run, self.model) as staging:  # visible at `filepath` once complete
            super().save_checkpoint(checkpoint, staging, storage_options)
        self.committed_checkpoint = str(filepath)  # named if a lost peer ends the run (peer_watchdog.py)
        if self.handle_preemption:
            self._save_deadline.observe(time.monotonic() - started)
        if self.global_rank == 0 and run["global_step"] is not None and is_preemption_checkpoint(Path(filepath)):
            self._retire_older_preemption_checkpoints(run["global_step"])

    def _retire_older_preemption_checkpoints(self, committed_step: int) -> None:
        # Only a newer preemption checkpoint retires older ones: Lightning's SLURM auto-resume (`ckpt_path=None`)
        # looks at these names alone, and must always find the newest.
        trainer = self.lightning_module.trainer
        keep = next((c.keep for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint)), DEFAULT_KEEP)
        try:
            for line in retire_older_preemption_checkpoints(Path(trainer.default_root_dir), committed_step, keep):
                log.info("Preemption checkpoint retired: %s", line)
        except OSError as error:  # housekeeping: never worth failing a run (or hanging the other ranks) over
            log.warning("Could not retire older preemption checkpoints in %s: %s", trainer.default_root_dir, error)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        loading = contextlib.nullcontext()
        if not (self.load_full_weights and self.zero_stage_3):  # a single-file checkpoint: Lightning loads it
            checkpoint_path, loading = resume.prepare_load(
                self, checkpoint_path, self.lightning_module, self.model, keep_data_order=self._fits_exactly()
            )
        with loading, partitioning.optimizer_less_checkpoint_load(self.model):
            checkpoint = super().load_checkpoint(checkpoint_path, **weights_only_argument(weights_only))
        # Lightning's loops would replay an epoch-end checkpoint as a finished epoch plus one batch (see the module).
        epoch_end_checkpoint.complete_epoch_saved_at_epoch_end(checkpoint)
        self._resumed_data_order = data_order.saved_order(checkpoint)
        if self.lightning_module is not None and self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            random_layers.warn_if_resume_draws_random_numbers(self.lightning_module)
        self._after_weights_changed()
        return checkpoint

    def _fits_exactly(self) -> bool:
        """Whether the resume must repeat the data order: ``fit`` under ``exact_resume`` (evaluation has none)."""
        trainer = attached_trainer(self.lightning_module)
        return self.exact_resume and trainer is not None and trainer.state.fn == TrainerFn.FITTING

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        self._after_weights_changed()

    @override
    @contextlib.contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        self._tune_structure(self.lightning_module)  # zero.Init builds parameters with the hpZ size it finds
        with super().model_sharded_context():
            yield
        if self.zero_stage_3 and self.lightning_module is not None:
            # zero.Init computed buffers such as rotary frequencies in the training precision; ZeRO-1/2 in float32
            recompute_buffers_in_float32(self.lightning_module)
            # `configure_model` may have written weights into the shards: no secondary copy may keep the old values.
            partitioning.refresh_secondary_partitions(self.lightning_module)

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if self.zero_stage_3:
            partitioning.order_converted_parameters(self._hpz_module())  # converted by a zero.Init before setup
        self._watch_load_state_dict(self._hpz_module())


def register() -> None:
    HpzStrategy.register_strategies(StrategyRegistry)


# Importing the strategy registers its names; strategy/registration.py imports it as soon as Lightning is loaded.
register()
