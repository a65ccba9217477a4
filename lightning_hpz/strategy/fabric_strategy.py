"""``HpzFabricStrategy``: Fabric's DeepSpeed strategy with stabilized hierarchical partitioning (hpZ), CPU and GPU."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY, DeepSpeedStrategy
from lightning.fabric.utilities.seed import reset_seed
from typing_extensions import override

from lightning_hpz import partitioning
from lightning_hpz.checkpointing import commit, compatibility, resume
from lightning_hpz.lifecycle.polled_preemption import PolledPreemption
from lightning_hpz.lightning_internals import (
    FabricDeepSpeedHooks,
    FabricOptimizer,
    allow_separate_optimizer_setup,
    deepspeed_engines_in,
    weights_only_argument,
)
from lightning_hpz.strategy.accumulate_until_step import ACCUMULATE_UNTIL_STEP, AccumulateUntilStep
from lightning_hpz.strategy.deferred_engine import DeferredEngine
from lightning_hpz.strategy.hpz_setup import HpzSetup


class HpzFabricStrategy(HpzSetup, FabricDeepSpeedHooks):
    """ZeRO stages 1-3 with stabilized hpZ for Fabric, registered as ``Fabric(strategy="hpz")`` (and ``zero3``, ...).

    Takes every argument of :class:`~lightning_hpz.strategy.hpz_setup.HpzSetup` (``stage``, ``hpz_partition_size``,
    ``quantized_weights``, ``quantized_gradients``, ``hpz_sync``, ``emulate_async_copy``, ``verify_after_load``,
    ``peer_timeout``, ``heartbeat_interval``, ``config``)
    and of Fabric's :class:`~lightning.fabric.strategies.DeepSpeedStrategy`, with the same defaults,
    checks and messages as the Trainer's :class:`~lightning_hpz.HpzStrategy`.

    In a training loop, ``fabric.strategy.check_secondary_partitions()`` (between forward and backward, on every
    rank) verifies the secondary partitions and ``fabric.strategy.refresh_secondary_partitions()`` drops them after
    you write sharded weights yourself. ``fabric.load`` refreshes them and, with ``verify_after_load``, checks them at
    the next ``fabric.backward``. Call ``fabric.strategy.teardown()`` when done: Fabric never calls it itself, and
    it undoes what setup installed in DeepSpeed.

    ``fabric.save`` commits a checkpoint as the Trainer's strategy does (staging folder, integrity manifest, rename)
    and ``fabric.load`` verifies it first, refusing a damaged or incompatible one alike on every rank and converting
    one written on another number of ranks (docs/checkpoints.md, "Fabric").

    Unlike Lightning's DeepSpeed strategy, it also runs loops written for FSDP-style strategies (LitGPT's among them):
    ``fabric.setup(model)`` then ``fabric.setup_optimizers(optimizer)`` builds the engine at the second call;
    ``fabric.clip_gradients(..., max_norm=...)`` clips by the global norm inside the next step (the returned tensor
    receives that step's norm); ``fabric.no_backward_sync`` accumulates until ``optimizer.step()``, which is the
    accumulation boundary; and ``optimizer.step()`` steps DeepSpeed's engine.
    """

    builds_engine_in_two_steps = True  # exempts it from Fabric's refusal of `setup_optimizers` under DeepSpeed
    _lightning_deepspeed_strategy = DeepSpeedStrategy

    _deferred: Optional[DeferredEngine] = None  # the latest from setup_module
    _waiting: tuple[DeferredEngine, ...] = ()  # set up alone, engine not built yet: one may get an optimizer
    _open_writes: tuple[Any, ...] = ()  # partitioning.OpenWrites, one per `fabric.init_module()`, until set-up
    _pending_clip: Optional[tuple[float, torch.Tensor]] = None  # (max_norm, the norm to fill) at the next step
    _preemption: Optional[PolledPreemption] = None  # the signals recorded from setup_environment to teardown

    @override
    def configure_launcher(self) -> None:
        super().configure_launcher()
        # While Fabric is built with this strategy. Fabric refuses `setup_optimizers` for every DeepSpeed strategy
        # before asking it, although the strategy builds the engine; for this one its other checks keep their
        # meaning, in this module's words.
        allow_separate_optimizer_setup(_check_separate_optimizers)

    @override
    def backward_sync_control(self) -> AccumulateUntilStep:
        # Lightning's is None ("DeepSpeed handles gradient accumulation internally"); here the loop owns it.
        return ACCUMULATE_UNTIL_STEP

    @override
    def engine_to_keep(self, engine: Any) -> Any:
        # Fabric's backward assigns the module it was given (the `_FabricModule`'s inner one) as the engine; when
        # that is a DeferredEngine the strategy keeps the engine inside it.
        return engine.built_engine() if isinstance(engine, DeferredEngine) else engine

    @override
    def setup_distributed(self) -> None:
        if not self.on_cpu:
            super().setup_distributed()
            return
        # Fabric's own (lightning/fabric/strategies/deepspeed.py) first validates device indices, which a CPU device
        # does not have; the rest is the same.
        reset_seed()
        self.set_world_ranks()
        self.init_deepspeed_distributed()
        self.format_config_once()

    @override
    def initialize_engine(
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
        # `model.load_state_dict(whole_weights)` after set-up, as scripts for DDP or FSDP do: the weights reach the
        # ZeRO-3 shards and the optimizer's master copy, which the next step would otherwise restore
        partitioning.loads_reach_shards(model, after_load=lambda: partitioning.refresh_master_weights(engine))
        self._watch_load_state_dict(model)
        return engine, deepspeed_optimizer, deepspeed_scheduler

    @override
    def format_config(self) -> None:
        super().format_config()
        partitioning.request_loop_owned_accumulation(self.config)

    @override
    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        # Deliberate change: Lightning refuses `empty_init=False` under ZeRO-3, yet zero.Init runs every initializer
        # (the weights are initialised as asked, then sharded). LitGPT's fine-tuning loops ask for it on one device.
        if self.zero_stage_3 and empty_init is False:
            empty_init = None
        context = super().module_init_context(empty_init=empty_init)
        return self._writes_reach_shards_after(context) if self.zero_stage_3 else context

    @contextmanager
    def _writes_reach_shards_after(self, init_context: AbstractContextManager) -> Iterator[None]:
        # Loops written for other strategies re-initialise (LitGPT: every `reset_parameters`) or load the model
        # between `fabric.init_module()` and `fabric.setup`; under ZeRO-3 those writes must reach the shards.
        with partitioning.registered_parameters() as built, init_context:
            yield
        # kept open for every model built so far (a student, then a teacher, re-initialised after both were built)
        self._open_writes = (*self._open_writes, partitioning.OpenWrites(built))

    def _close_open_writes(self, module: Optional[torch.nn.Module] = None) -> None:
        """Close the windows of ``module``'s parameters (set up now), or all of them (``None``: teardown)."""
        closing = [window for window in self._open_writes if module is None or window.covers(module)]
        self._open_writes = tuple(window for window in self._open_writes if window not in closing)
        for window in reversed(closing):
            window.close()

    @override
    def setup_module_and_optimizers(self, module: torch.nn.Module, optimizers: Any, scheduler: Any = None) -> Any:
        self._close_open_writes(module)
        return super().setup_module_and_optimizers(module, optimizers, scheduler)

    @override
    def setup_module(self, module: torch.nn.Module) -> DeferredEngine:
        # The engine needs the optimizer, which an FSDP-style loop creates from the set-up model and hands to
        # `setup_optimizers` next; without one, the first use builds an inference engine, as Lightning does here.
        self._close_open_writes(module)
        self._deferred = DeferredEngine(module, self._build_inference_engine)
        self._waiting = (*self._waiting, self._deferred)
        return self._deferred

    def _build_inference_engine(self, module: torch.nn.Module) -> Any:
        self.deepspeed_engine, _, _ = self.initialize_engine(module)
        return self.deepspeed_engine

    @override
    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> Any:
        deferred = self._model_of(optimizer)
        engine, zero_optimizer, _ = self.initialize_engine(deferred.module, optimizer)
        self.deepspeed_engine = engine
        self.configure_activation_checkpointing()
        deferred.attach(engine)
        # The loop gets its own optimizer back (DeepSpeed steps it inside the ZeRO optimizer, over the shards): it is
        # a torch Optimizer, so torch's schedulers accept it and `defaults`/`param_groups` read as the loop expects
        # (LitGPT reads `optimizer.defaults["lr"]`). `optimizer.step()` still steps the engine (`optimizer_step`).
        inner = getattr(zero_optimizer, "optimizer", None)
        return inner if isinstance(inner, torch.optim.Optimizer) else zero_optimizer

    def _model_of(self, optimizer: torch.optim.Optimizer) -> DeferredEngine:
        """The model set up alone, engine not built yet, whose parameters ``optimizer`` holds (several may wait:
        a policy and its reference model)."""
        self._waiting = tuple(waiting for waiting in self._waiting if not waiting.built)
        held = {id(param) for group in optimizer.param_groups for param in group["params"]}
        owners = [w for w in self._waiting if any(id(param) in held for param in w.module.parameters())]
        if len(owners) != 1:
            raise RuntimeError(_no_model_waits_for_an_optimizer(self._deferred, owners=len(owners)))
        return owners[0]  # leaves the waiting ones at the next call: its engine is built now

    def _built_deferred_engine(self) -> None:
        if self._deferred is not None and self.deepspeed_engine is None:
            self._deferred.built_engine()

    @override
    def module_sharded_context(self) -> Any:
        self._tune_structure(None)  # zero.Init builds parameters with the hpZ size it finds; the model is not known yet
        return super().module_sharded_context()

    @override
    def _hpz_module(self) -> torch.nn.Module:
        self._built_deferred_engine()
        if self.deepspeed_engine is None:
            raise RuntimeError(
                "HpzFabricStrategy has no model yet: call `fabric.setup(model, optimizer)` before checking or "
                "refreshing secondary partitions."
            )
        return self.deepspeed_engine.module

    @override
    def backward(self, tensor: torch.Tensor, module: Optional[torch.nn.Module], *args: Any, **kwargs: Any) -> None:
        self._verify_if_due()
        self._check_memory_if_due()
        super().backward(tensor, module, *args, **kwargs)
        self._note_progress()

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        clip, self._pending_clip = self._pending_clip, None
        with partitioning.clipped_step(self.deepspeed_engine, clip[0]) if clip else nullcontext():
            output = super().optimizer_step(self._stepped_through_engine(optimizer, kwargs), **kwargs)
        if clip:
            partitioning.write_step_norm(self.deepspeed_engine, into=clip[1])
        self._note_optimizer_step()
        self._note_progress()
        return output

    @override
    def clip_gradients_norm(
        self,
        module: Any,
        optimizer: Any,
        max_norm: Union[float, int],
        norm_type: Union[float, int] = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clip by the global 2-norm over every shard in the next ``optimizer.step()``; returns that step's norm.

        The gradient exists whole only inside DeepSpeed's step (see :mod:`lightning_hpz.partitioning.step_clipping`),
        so the returned tensor holds NaN until the step has run and the norm before clipping after it. Read it after
        ``optimizer.step()``. A non-finite norm is left to DeepSpeed: fp16 skips that step, bf16 and fp32 apply it.
        """
        if float(norm_type) != 2.0:
            raise ValueError(
                f"norm_type={norm_type} cannot be clipped by DeepSpeed, which computes the 2-norm over its gradient "
                "shards only: leave norm_type at 2."
            )
        if max_norm <= 0:
            raise ValueError(f"max_norm={max_norm} must be positive.")
        self._built_deferred_engine()
        partitioning.clipping_optimizer(self.deepspeed_engine)  # refuses clearly now, not at the step
        norm = torch.full((), float("nan"), device=self.root_device)
        self._pending_clip = (float(max_norm), norm)
        return norm

    @override
    def clip_gradients_value(self, module: Any, optimizer: Any, clip_val: Union[float, int]) -> None:
        raise NotImplementedError(
            "DeepSpeed clips gradients by their global norm only, inside its step: use "
            "`fabric.clip_gradients(model, optimizer, max_norm=...)` instead of `clip_val`."
        )

    def _stepped_through_engine(self, optimizer: Any, kwargs: dict[str, Any]) -> Any:
        """The engine, when Fabric hands over the engine's own optimizer (it does: Fabric's ``_FabricOptimizer`` steps
        the engine only when the engine passes its ``Optimizable`` check, which DeepSpeed's does not).

        Stepping the ZeRO optimizer directly skips what ``DeepSpeedEngine.step()`` does around it: the scheduler of
        the DeepSpeed config, the global step and sample counters (checkpoints record them), the accumulation
        boundary and what happens there, the monitor.
        """
        engine = self.deepspeed_engine
        if engine is None or not self._is_engine_optimizer(optimizer):
            return optimizer
        if "closure" in kwargs:
            # the engine's step takes none, the ZeRO optimizer's ignores it, and the loop's own optimizer would step
            # the shards past DeepSpeed's reduction
            raise ValueError(
                "`optimizer.step(closure)` cannot run under DeepSpeed, whose step re-evaluates nothing: compute the "
                "loss and call `fabric.backward(loss)` before `optimizer.step()`."
            )
        return engine

    def _is_engine_optimizer(self, optimizer: Any) -> bool:
        """``optimizer`` is the engine's ZeRO optimizer or the loop's optimizer inside it (see ``setup_optimizer``)."""
        zero_optimizer = getattr(self.deepspeed_engine, "optimizer", None)
        if zero_optimizer is None:
            return False
        return optimizer is zero_optimizer or optimizer is getattr(zero_optimizer, "optimizer", None)

    @override
    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Optional[Any] = None, filter: Optional[Any] = None
    ) -> None:
        """Lightning's sharded save, committed as the Trainer's is (checkpointing/commit.py): written into a staging
        folder beside ``path``, checksummed into ``hpz_manifest.json``, and moved to ``path`` once complete."""
        self._built_deferred_engine()
        # the loop's optimizer stands for the ZeRO optimizer, whose state the engine saves itself (sharded); Lightning
        # leaves only the ZeRO optimizer out of the client state
        engine_optimizer = getattr(self.deepspeed_engine, "optimizer", None)
        state = {key: engine_optimizer if self._is_engine_optimizer(value) else value for key, value in state.items()}
        engine = _engine_in(state)
        if engine is None or storage_options is not None or filter is not None:
            # refused by Lightning, with its own message, before anything is written
            super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)
            return
        path = Path(self.broadcast(path))
        run = compatibility.describe_run(self, engine.module, engine, global_step=engine.global_steps)
        with commit.committed_save(path, run, engine) as staging:
            super().save_checkpoint(staging, state)
        self.committed_checkpoint = str(path)  # named if a lost peer ends the run (peer_watchdog.py)

    @override
    def setup_environment(self) -> None:
        self._preemption = PolledPreemption()
        self._preemption.install()  # before the process group: a signal from here on is recorded, not fatal
        super().setup_environment()

    def preemption_requested(self) -> bool:
        """Whether SIGTERM or SIGUSR1 reached any rank since set-up, the same answer on every rank.

        One all-reduce of a flag on the default process group: call it on every rank at the same point of the loop
        (after ``optimizer.step()``), then save and leave together: ``fabric.save(path, state)``, then
        ``raise TrainingPreempted(message, fabric, path)`` (exit 75), or ``raise PreemptedWithoutCheckpoint(message,
        fabric)`` (exit 143) with nothing to save (both in ``lightning_hpz.lifecycle.run_exit``). Until a loop first
        calls it, a signal ends the process as it did before set-up (see lifecycle/polled_preemption.py).
        """
        return self._preemption is not None and self._preemption.requested()

    @override
    def teardown(self) -> None:
        self._close_open_writes()
        if self._preemption is not None:  # the handlers in place before set-up are back
            self._preemption.uninstall()
        commit.finish_saves()  # the checkpoint folders this run claimed are free for the next job
        super().teardown()

    @override
    def load_module_state_dict(self, module: torch.nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        # `fabric.load_raw(path, model)`: a plain state dict of the model (LitGPT's `lit_model.pth`), whose keys
        # have no engine prefix; under ZeRO-3 the model's `load_state_dict` writes into the shards.
        engine = module.built_engine() if isinstance(module, DeferredEngine) else module
        getattr(engine, "module", engine).load_state_dict(state_dict, strict=strict)

    @override
    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: Optional[bool] = None
    ) -> dict[str, Any]:
        """Lightning's load; a sharded checkpoint is first verified against its manifest, compared with this run and,
        written on another number of ranks, converted (checkpointing/resume.py), every refusal the same on all ranks.
        A single file (``load_full_weights``, ``fabric.load_raw``) is Lightning's alone."""
        self._built_deferred_engine()
        engine = _engine_in(state) if state else None
        loading: AbstractContextManager = nullcontext()
        if engine is not None and not (self.load_full_weights and self.zero_stage_3):
            # A Fabric loop owns its data order (no `exact_resume`): another number of ranks is converted, warned about.
            path, loading = resume.prepare_load(self, path, engine.module, engine, keep_data_order=False)
        with loading:
            remainder = super().load_checkpoint(path, state=state, strict=strict, **weights_only_argument(weights_only))
        if self.deepspeed_engine is not None:
            self._after_weights_changed()
        return remainder


def _engine_in(state: Any) -> Optional[Any]:
    """The DeepSpeed engine a ``fabric.save``/``fabric.load`` state holds, found as Lightning finds it; None where
    Lightning refuses the state (no engine, several) or does not load into an engine (a module or optimizer alone)."""
    engines = deepspeed_engines_in(state) if isinstance(state, dict) else []
    return engines[0] if len(engines) == 1 else None


def _check_separate_optimizers(fabric: Any, optimizers: Sequence[Any]) -> None:
    if not optimizers:
        raise ValueError("`fabric.setup_optimizers` needs the optimizer to set up: `fabric.setup_optimizers(opt)`.")
    if any(isinstance(optimizer, FabricOptimizer) for optimizer in optimizers):
        raise ValueError("This optimizer was set up already; pass the bare optimizer once.")
    if len(optimizers) != 1:
        raise ValueError(
            f"DeepSpeed trains one optimizer per engine, got {len(optimizers)}: combine their parameter groups into "
            "one optimizer."
        )


def _no_model_waits_for_an_optimizer(deferred: Optional[DeferredEngine], owners: int) -> str:
    start = "`fabric.setup_optimizers` with DeepSpeed builds the engine of the model whose parameters it holds, but "
    if deferred is None:
        return start + "no model was set up: call `fabric.setup(model)` first."
    if owners > 1:
        return start + "its parameters belong to several models set up alone. DeepSpeed trains one model per engine."
    return start + (
        "no model set up alone and still without an engine holds them: that model has an optimizer already, or was "
        "used (run, saved, loaded) before one was set up, which builds it for inference. Set up the model and its "
        "optimizer together, `fabric.setup(model, optimizer)`, or call `setup_optimizers` before using the model."
    )


def register() -> None:
    HpzFabricStrategy.register_strategies(STRATEGY_REGISTRY)


# Importing the strategy registers its names with Fabric; lightning_hpz.strategy.registration imports it with Lightning.
register()
