"""``LossStabilityMonitor``: detect NaN/Inf losses, loss and gradient-norm spikes and divergence, and act on them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple, Optional, Union

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_hpz import collectives
from lightning_hpz.callbacks.loss_gate import LossGate
from lightning_hpz.callbacks.pending_verdicts import PendingLoss, PendingStep, ReadLoss, read_pending
from lightning_hpz.callbacks.reading_cadence import is_reading_step
from lightning_hpz.callbacks.stability_detection import (
    ACTIONS,
    StabilityDecision,
    StabilityEvent,
    StabilityState,
    StabilityThresholds,
    _decide,
)
from lightning_hpz.callbacks.stability_report import plot_loss_curve, stability_summary, write_summary
from lightning_hpz.lifecycle.run_exit import TrainingStopped


class UpdateNotSkippedError(RuntimeError):
    """The engine applied an update the monitor had asked it to drop."""


class JudgedLoss(NamedTuple):
    decision: StabilityDecision
    events: list[StabilityEvent]


class LossStabilityMonitor(Callback):
    """Watch the training loss and the global gradient norm; warn, stop, skip the update, or roll back.

    Detectors (pure functions in :mod:`lightning_hpz.callbacks.stability_detection`): a non-finite loss; a loss
    ``z_threshold`` deviations above the running mean of the last ``window`` normal losses for ``patience`` steps in a
    row; the same for the global gradient norm (under DeepSpeed the engine's own norm over all shards, read after the
    step; Lightning's ``grad_norm`` would see only this rank's shard); divergence: the loss above its starting level
    (the mean of the first ``warmup`` losses) for ``divergence_steps`` steps in a row.

    The loss is averaged over all ranks before it is judged (one all-reduce of a scalar per micro-batch, queued on
    the device), and the gradient norm is global, so every rank takes the same decision without further
    communication.

    When values are read: the verdict on each loss is taken on its device (:class:`~lightning_hpz.callbacks.
    loss_gate.LossGate`) against statistics frozen at the last read, and an update is dropped by a gradient factor
    that never leaves the device. Under a DeepSpeed strategy with ``action="warn"`` or ``"skip"`` the host reads the
    values of the steps since then once per ``trainer.log_every_n_steps`` (and at a checkpoint and at the end): a step
    that does not log waits for nothing (the first steps, until ``warmup`` losses are known, are read at once).
    Warnings, ``skipped`` and the report are written then. ``"stop"`` and ``"rollback"`` act on the host, so they
    read every micro-batch's verdict at once, as do other strategies (they drop an update by clearing gradients on
    the host).

    Args:
        action: ``"warn"``; ``"stop"``: drop the offending update, save ``stopped-step<N>.ckpt`` into ``dirpath`` and
            stop on all ranks (resume with ``ckpt_path=``); ``"skip"``: drop the update of the offending batch (a
            gradient-norm spike or a divergence is known only after updates were applied, so it is warned about);
            ``"rollback"``: drop the offending update and restore ``last-good.ckpt`` (saved at the start of training
            and every ``checkpoint_every_n_steps`` clean steps); training continues with the batches after the
            offending one, so the offending batch and those since the checkpoint are skipped. After
            ``max_rollbacks`` rollbacks the monitor stops instead.
        dirpath: where checkpoints, ``stability_summary.json``, ``skip_batches.json`` and ``loss_curve.png`` go.
            Default: ``<log_dir>/stability``.

    How an update is dropped: under a DeepSpeed strategy the loss's gradient is replaced by NaN, so the engine's own
    overflow guard discards the whole step on every rank (weights and optimizer states untouched); the monitor checks
    ``engine.was_step_applied()`` and raises :class:`UpdateNotSkippedError` if it was not discarded (bf16 with ZeRO
    1/2 does not check for overflow). Under fp16 the dynamic loss scaler is put back as it was before a dropped step,
    so a drop (or its replay after a resume) neither shrinks the scale nor restarts its count of clean steps. Under
    other strategies the gradients are set to ``None`` before the optimizer step, which a torch optimizer then leaves
    alone. With gradient accumulation the whole optimizer step is dropped.
    Batches dropped once are dropped again when a resumed run meets them (``skip_batches.json``).
    """

    def __init__(
        self,
        action: str = "warn",
        window: int = 50,
        warmup: int = 10,
        z_threshold: float = 6.0,
        patience: int = 1,
        grad_z_threshold: float = 6.0,
        min_relative_std: float = 0.01,
        divergence_steps: int = 20,
        divergence_margin: float = 0.0,
        checkpoint_every_n_steps: int = 50,
        max_rollbacks: int = 3,
        dirpath: Optional[str] = None,
        plot: bool = True,
    ) -> None:
        if action not in ACTIONS:
            raise ValueError(f"LossStabilityMonitor(action={action!r}): choose one of {ACTIONS}.")
        if checkpoint_every_n_steps < 1 or max_rollbacks < 0:
            raise ValueError("checkpoint_every_n_steps must be >= 1 and max_rollbacks >= 0.")
        self.action = action
        self.thresholds = StabilityThresholds(
            window=window,
            warmup=warmup,
            z_threshold=z_threshold,
            patience=patience,
            grad_z_threshold=grad_z_threshold,
            min_relative_std=min_relative_std,
            divergence_steps=divergence_steps,
            divergence_margin=divergence_margin,
        )
        self.checkpoint_every_n_steps = checkpoint_every_n_steps
        self.max_rollbacks = max_rollbacks
        self.dirpath = Path(dirpath) if dirpath else None
        self.plot = plot
        self.state = StabilityState(self.thresholds)
        self.losses: list[tuple[int, float]] = []
        self.events: list[StabilityEvent] = []
        self.rollbacks: list[dict[str, Any]] = []
        self.skipped: list[dict[str, Any]] = []
        self.skip_batches: set[tuple[int, int]] = set()
        self.stop_checkpoint: Optional[str] = None
        self.good_checkpoint_step: Optional[int] = None
        self.gate = LossGate(patience, drops_updates=action != "warn")
        self._pending: list[Union[PendingLoss, PendingStep]] = []
        self._dropped_steps: set[int] = set()
        self._step_drops: list[torch.Tensor] = []
        self._scale_before_step: Optional[dict[str, Any]] = None
        self._reads_every_step = True
        self._accumulate = 1
        self._step = -1
        self._batch_key = (0, 0)
        self._decision = StabilityDecision()
        self._step_events: list[StabilityEvent] = []
        self._clear_gradients = False
        self._local_grad_norm: Optional[float] = None
        self._engine_skipped_at_start = 0
        self._stop_reason = ""

    # ------------------------------------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.dirpath is None:
            self.dirpath = Path(trainer.log_dir or trainer.default_root_dir) / "stability"
        skip_file = self.dirpath / "skip_batches.json"
        if skip_file.is_file():
            self.skip_batches |= {tuple(key) for key in json.loads(skip_file.read_text())}
        # stop and rollback act on the host; other strategies drop an update on the host (see the class docstring)
        acts_on_host = self.action in ("stop", "rollback") or not isinstance(trainer.strategy, DeepSpeedStrategy)
        self._reads_every_step = acts_on_host

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch_key, self._step = (trainer.current_epoch, batch_idx), trainer.global_step
        self._decision, self._step_events = StabilityDecision(), []
        self._local_grad_norm = None

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self._step, self._accumulate = trainer.global_step, trainer.accumulate_grad_batches
        mean_loss = _mean_over_ranks(loss.detach().float() * trainer.accumulate_grad_batches)
        verdict = self.gate.judge(mean_loss, listed=self._batch_key in self.skip_batches)
        if isinstance(trainer.strategy, DeepSpeedStrategy):
            # NaN gradients trip the engine's overflow guard, which discards the step on all ranks; the factor is
            # 1.0 or NaN on the device, so nothing here waits for the verdict
            loss.register_hook(lambda grad: grad * verdict.gradient_factor.to(grad.dtype))
        self._pending.append(PendingLoss(self._step, self._batch_key, mean_loss, verdict))
        self._step_drops.append(verdict.drop)
        if self._reads_every_step:
            (judged,) = self._judge_pending()
            self._decision, self._step_events = judged.decision, judged.events
            self._clear_gradients |= judged.decision.skip_update and not isinstance(trainer.strategy, DeepSpeedStrategy)

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if isinstance(trainer.strategy, DeepSpeedStrategy):
            from lightning_hpz.partitioning import snapshot_loss_scale  # DeepSpeed internals live there

            # fp16: a drop must not count as an overflow (see on_train_batch_end); plain Python values, no sync
            self._scale_before_step = snapshot_loss_scale(trainer.strategy.deepspeed_engine)
            return  # gradients live in the engine's shards; its global norm is read after the step
        if self._clear_gradients:  # a dropped update's gradient norm is not judged (as under DeepSpeed)
            optimizer.zero_grad(set_to_none=True)
            self._clear_gradients = False  # kept over the micro-batches of the step: one dropped drops all
            return
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        if grads and isinstance(trainer.strategy, (DDPStrategy, SingleDeviceStrategy)):
            # Under DDP every rank holds the same all-reduced gradients, so this norm is global and equal on all ranks.
            self._local_grad_norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stepped = trainer.global_step > self._step  # the optimizer stepped after this micro-batch
        if stepped:
            self._keep_loss_scale_of_dropped_step(trainer)
        if not self._reads_every_step:
            if stepped:
                self._pending.append(self._pending_step(trainer))
                if is_reading_step(trainer) or not self.gate.armed:  # each step until spikes can be judged
                    self._judge_pending()
            return
        decision, events = self._decision, list(self._step_events)
        grad_norm = self._global_grad_norm(trainer, decision) if stepped else None
        if grad_norm is not None:
            grad_events = self.state.observe_grad_norm(self._step, grad_norm)
            grad_decision = self._decide(grad_events)
            decision = _merge(decision, grad_decision)
            events += grad_events
        self.events += events
        if decision.skip_update:
            self._record_skip(self._step, self._batch_key, events)
        if events:
            self._report(self._step, events, decision)
        if decision.rollback:
            self._rollback(trainer)
        elif decision.stop:
            self._stop_reason = ", ".join(e.kind for e in events) or "instability"
            self._stop(trainer)
        elif self._should_save_good_checkpoint(events):
            self._save_good_checkpoint(trainer, self._step + 1)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._engine_skipped_at_start = _engine_skipped_steps(trainer)
        if self.action == "rollback":
            self._save_good_checkpoint(trainer, trainer.global_step)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._judge_pending()
        if trainer.is_global_zero:
            self._write_report(trainer)
        if self.stop_checkpoint is not None:  # the same decision on every rank: all leave with the same exit code
            message = (
                f"Training stopped by LossStabilityMonitor at step {self._step}: {self._stop_reason}. Checkpoint "
                f"before the instability: {self.stop_checkpoint}. Details: {self.dirpath}"
            )
            rank_zero_warn(message)
            raise TrainingStopped(message, trainer, self.stop_checkpoint)

    def _write_report(self, trainer: Trainer) -> None:
        if self.skip_batches:
            self._write_skip_batches()
        assert self.dirpath is not None
        dropped = _engine_skipped_steps(trainer)
        summary = stability_summary(
            events=self.events,
            max_loss_zscore=self.state.loss.max_zscore,
            max_grad_norm_zscore=self.state.grad_norm.max_zscore,
            rollbacks=self.rollbacks,
            skipped=self.skipped,
            stop_checkpoint=self.stop_checkpoint,
            steps_observed=len(self.losses),
            updates_dropped_by_engine=None if dropped is None else dropped - self._engine_skipped_at_start,
        )
        write_summary(self.dirpath / "stability_summary.json", summary)
        if self.plot:
            rollback_steps = [r["step"] for r in self.rollbacks]
            plot_loss_curve(self.dirpath / "loss_curve.png", self.losses, self.events, rollback_steps)
        engine_note = (
            "" if dropped is None else f", {summary['updates_dropped_by_engine']} updates dropped by the engine"
        )
        rank_zero_info(
            f"Stability: {summary['nonfinite_losses']} non-finite losses, {summary['loss_spikes']} loss spikes "
            f"(max z {summary['max_loss_zscore']}), {summary['grad_norm_spikes']} gradient-norm spikes, "
            f"{summary['divergences']} divergences, {len(self.rollbacks)} rollbacks, {len(self.skipped)} skipped "
            f"batches{engine_note}. Details: {self.dirpath}"
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        self._judge_pending()  # a checkpoint carries every skip decided so far
        return {"skip_batches": sorted(self.skip_batches), "rollbacks": self.rollbacks, "skipped": self.skipped}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skip_batches |= {tuple(key) for key in state_dict.get("skip_batches", [])}
        self.rollbacks = list(state_dict.get("rollbacks", []))
        self.skipped = list(state_dict.get("skipped", []))

    # ------------------------------------------------------------------------------------------------ reading
    def _judge_pending(self) -> list[JudgedLoss]:
        """Read what the device decided since the last read and replay it through the detectors.

        Returns the judgement of each pending loss. Reading every micro-batch, the caller acts on it; reading every
        few steps (see the class docstring), the events, skips and warnings of those steps are recorded here.
        """
        pending, self._pending = self._pending, []
        judged = []
        for record in read_pending(pending):
            if isinstance(record, ReadLoss):
                judged.append(self._judge_loss(record))
            else:
                self._judge_step(record.step, record.applied, record.grad_norm)
        self.state.freeze()  # the device judges the next losses against the statistics as they are now
        self.gate.set_limit(self.state.loss_limit())
        return judged

    def _judge_loss(self, record: ReadLoss) -> JudgedLoss:
        events = self.state.observe_loss(record.step, record.loss, spiky=record.spiky)
        decision = self._decide(events)
        decision = replace(decision, skip_update=record.drop)  # what the device did (the skip list included)
        self.losses.append((record.step, record.loss))
        if not self._reads_every_step:  # warn or skip: nothing is left to do on the host but to record it
            self.events += events
            if record.drop:
                self._record_skip(record.step, record.batch_key, events)
                self._dropped_steps.add(record.step)
            if events:
                self._report(record.step, events, decision)
        return JudgedLoss(decision, events)

    def _judge_step(self, step: int, applied: bool, grad_norm: Optional[float]) -> None:
        dropped = step in self._dropped_steps
        self._dropped_steps.discard(step)
        if dropped and applied and self._accumulate == 1:
            raise _not_skipped(step)
        if applied and grad_norm is not None:
            events = self.state.observe_grad_norm(step, grad_norm)
            self.events += events
            if events:  # known after the update was applied: warned about (see ``_decide``)
                self._report(step, events, self._decide(events))

    def _keep_loss_scale_of_dropped_step(self, trainer: Trainer) -> None:
        """Under fp16, undo what a step this monitor dropped did to DeepSpeed's loss scaler.

        Only a step the engine discarded is looked at (the engine has already waited for the device to find the
        overflow), and only then are this step's drop verdicts read: on any other step nothing here reads a value.
        """
        drops, self._step_drops = self._step_drops, []
        snapshot, self._scale_before_step = self._scale_before_step, None
        if snapshot is None or not drops or trainer.strategy.deepspeed_engine.was_step_applied():
            return
        if bool(torch.stack(drops).any()):
            from lightning_hpz.partitioning import restore_loss_scale

            restore_loss_scale(trainer.strategy.deepspeed_engine, snapshot)

    def _pending_step(self, trainer: Trainer) -> PendingStep:
        engine = trainer.strategy.deepspeed_engine
        applied = bool(engine.was_step_applied())  # a host flag the engine set at its own overflow check
        return PendingStep(self._step, applied, engine.get_global_grad_norm() if applied else None)

    # ------------------------------------------------------------------------------------------------ actions
    def _global_grad_norm(self, trainer: Trainer, decision: StabilityDecision) -> Optional[float]:
        if not isinstance(trainer.strategy, DeepSpeedStrategy):
            return self._local_grad_norm
        engine = trainer.strategy.deepspeed_engine
        if decision.skip_update and trainer.accumulate_grad_batches == 1 and engine.was_step_applied():
            raise _not_skipped(self._step)
        if not engine.was_step_applied():
            return None
        norm = engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def _decide(self, events: list[StabilityEvent]) -> StabilityDecision:
        return _decide(events, self.action, self.max_rollbacks - len(self.rollbacks))

    def _record_skip(self, step: int, batch_key: tuple[int, int], events: list[StabilityEvent]) -> None:
        reason = ",".join(e.kind for e in events) or "skip list"
        epoch, batch_index = batch_key
        self.skipped.append({"step": step, "epoch": epoch, "batch": batch_index, "reason": reason})
        self.skip_batches.add(batch_key)

    def _should_save_good_checkpoint(self, events: list[StabilityEvent]) -> bool:
        completed = self._step + 1
        return (
            self.action == "rollback"
            and not events
            and self.state.loss.spiky_in_a_row == 0
            and completed % self.checkpoint_every_n_steps == 0
        )

    @property
    def good_checkpoint_path(self) -> Path:
        assert self.dirpath is not None
        return self.dirpath / "last-good.ckpt"

    def _save_good_checkpoint(self, trainer: Trainer, step: int) -> None:
        trainer.save_checkpoint(self.good_checkpoint_path)  # a collective under sharded strategies: all ranks call
        self.good_checkpoint_step = step

    def _rollback(self, trainer: Trainer) -> None:
        strategy = trainer.strategy
        checkpoint = strategy.load_checkpoint(self.good_checkpoint_path)
        if not isinstance(strategy, DeepSpeedStrategy):  # DeepSpeed restores weights and optimizer in its engine
            strategy.load_model_state_dict(checkpoint)
            strategy.load_optimizer_state_dict(checkpoint)
        self.state.forget_recent()
        self.gate.set_spiky_in_a_row(0)
        self.rollbacks.append({"step": self._step, "restored_step": self.good_checkpoint_step})
        if trainer.is_global_zero:
            self._write_skip_batches()

    def _stop(self, trainer: Trainer) -> None:
        assert self.dirpath is not None
        path = self.dirpath / f"stopped-step{self._step}.ckpt"
        trainer.save_checkpoint(path)
        self.stop_checkpoint = str(path)
        trainer.should_stop = True  # the same decision on every rank: all leave the loop after this batch

    def _write_skip_batches(self) -> None:
        assert self.dirpath is not None
        self.dirpath.mkdir(parents=True, exist_ok=True)
        (self.dirpath / "skip_batches.json").write_text(json.dumps(sorted(self.skip_batches)))

    def _report(self, step: int, events: list[StabilityEvent], decision: StabilityDecision) -> None:
        what = "; ".join(
            f"{e.kind} (value {e.value:.4g}" + (f", z {e.zscore:.1f})" if e.zscore is not None else ")") for e in events
        )
        done = [name for name in ("skip_update", "rollback", "stop") if getattr(decision, name)] or ["warn"]
        rank_zero_warn(f"Training instability at step {step}: {what}. Action: {', '.join(done)}.")


def _mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    # every rank gets the same mean, so every rank takes the same skip/rollback/stop decision; it stays on the device
    return collectives.all_reduce(value, op="sum") / collectives.world_size()


def _not_skipped(step: int) -> UpdateNotSkippedError:
    return UpdateNotSkippedError(
        f"DeepSpeed applied the update of step {step} although the monitor made its gradients NaN: this engine "
        "configuration does not check gradients for overflow (bf16 with ZeRO stage 1/2). Use action='rollback' (the "
        "restore undoes the update), or ZeRO stage 3 / fp32 / fp16."
    )


def _engine_skipped_steps(trainer: Trainer) -> Optional[int]:
    """Optimizer steps DeepSpeed's overflow guard discarded since the engine started (restored from checkpoints)."""
    engine = (
        getattr(trainer.strategy, "deepspeed_engine", None) if isinstance(trainer.strategy, DeepSpeedStrategy) else None
    )
    return int(getattr(engine, "skipped_steps", 0))


def _merge(first: StabilityDecision, second: StabilityDecision) -> StabilityDecision:
    return StabilityDecision(
        skip_update=first.skip_update or second.skip_update,
        rollback=first.rollback or second.rollback,
        stop=(first.stop or second.stop) and not (first.rollback or second.rollback),
        warn=first.warn or second.warn,
    )
