"""``TokenThroughputMonitor``: tokens/s, samples/s, TFLOP/s per device, MFU and bytes per step across/within nodes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_hpz import collectives, lightning_internals
from lightning_hpz.callbacks.batch_tokens import BatchTokens, _detect_batch_tokens
from lightning_hpz.callbacks.model_flops import TransformerShape, shape_from_config, training_flops
from lightning_hpz.callbacks.peak_flops import peak_flops_for
from lightning_hpz.callbacks.reading_cadence import is_reading_step
from lightning_hpz.callbacks.step_clock import StepClock
from lightning_hpz.callbacks.strategy_traffic import strategy_traffic
from lightning_hpz.planning import TrafficEstimate


class TokenThroughputMonitor(Callback):
    """Log training throughput to the Trainer's loggers, tokens/s also to the progress bar.

    Metrics (every ``trainer.log_every_n_steps`` once ``window_size`` steps are known, rates over that window):
    ``throughput/tokens_per_sec`` (real tokens of all ranks: padding excluded by the attention mask),
    ``throughput/device/tokens_per_sec``, ``throughput/samples_per_sec``, ``throughput/device/tflops_per_sec``,
    ``throughput/device/mfu``, and the communication model's ``comm/inter_node_bytes_per_step`` and
    ``comm/intra_node_bytes_per_step`` (what each rank sends per optimizer step; see :mod:`lightning_hpz.planning` and
    :mod:`lightning_hpz.callbacks.strategy_traffic` for what is assumed per strategy).

    Tokens, samples and FLOPs of all micro-batches of an optimizer step are summed over the ranks, so ranks with
    different batch sizes or padding count right; like Lightning's ``ThroughputMonitor``, rates are updated once per
    optimizer step, also under gradient accumulation. The rates come from Lightning's
    :class:`~lightning.fabric.utilities.throughput.Throughput`.

    A step that does not log never waits for the GPU: real tokens are counted on the batch's device, the end of the
    step is a CUDA event (:class:`~lightning_hpz.callbacks.step_clock.StepClock`), and the steps since the last log
    are summed over the ranks in one all-reduce when the next log is due (then the rates are updated step by step,
    as if each had been read at once).

    Args:
        model_config: a transformers config (or dict with the same keys) to count FLOPs from; default: the
            LightningModule's ``config``, or its ``model.config``, when it has one.
        flops_per_token: training FLOPs per computed position, instead of a config.
        peak_flops: peak FLOP/s of one device for MFU; default: NVIDIA's datasheet figure for A100/H100/H200 at the
            training dtype, a matmul measurement on a CPU, else no MFU.
        window_size: steps the rates are averaged over.
        tokens_fn: ``batch -> BatchTokens`` for batches that are not ``input_ids``/``attention_mask`` mappings.
    """

    def __init__(
        self,
        model_config: Optional[Any] = None,
        flops_per_token: Optional[float] = None,
        peak_flops: Optional[float] = None,
        window_size: int = 20,
        tokens_fn: Optional[Callable[[Any], BatchTokens]] = None,
    ) -> None:
        if window_size < 2:
            raise ValueError(f"window_size={window_size}: the rates need at least 2 steps.")
        if model_config is not None and flops_per_token is not None:
            raise ValueError("Give either model_config or flops_per_token, not both.")
        self.model_config = model_config
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.window_size = window_size
        self.tokens_fn = tokens_fn or _count_on_device
        self.shape: Optional[TransformerShape] = None
        self.traffic: Optional[TrafficEstimate] = None
        self.history: list[dict[str, float]] = []
        self._throughput: Optional[Throughput] = None
        self._totals = torch.zeros(3, dtype=torch.float64)  # real tokens, samples, optimizer steps (all ranks)
        self._step_tokens: Any = 0.0  # this rank's real tokens of this step (a device tensor when counted there)
        self._step_host_counts = [0.0, 0.0]  # this rank's samples and FLOPs of this step
        self._unread: list[list[Any]] = []  # [tokens, samples, FLOPs] of each step since the last log, this rank
        self._clock: Optional[StepClock] = None
        self._module_flops_per_batch: Optional[float] = None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        config = self.model_config if self.model_config is not None else _module_config(pl_module)
        if config is not None and self.flops_per_token is None:
            self.shape = shape_from_config(config)
        self._module_flops_per_batch = getattr(pl_module, "flops_per_batch", None)  # Lightning's own convention
        if self.peak_flops is None:
            dtype = lightning_internals.plugin_to_compute_dtype(trainer.precision_plugin)
            self.peak_flops = peak_flops_for(trainer.strategy.root_device, dtype)
        self._throughput = Throughput(
            available_flops=self.peak_flops, world_size=trainer.world_size, window_size=self.window_size
        )
        self._clock = StepClock(trainer.strategy.root_device)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.traffic = strategy_traffic(trainer, pl_module)
        if self.traffic is None:
            rank_zero_warn(f"TokenThroughputMonitor: no communication model for {type(trainer.strategy).__name__}.")
        if self.shape is None and self.flops_per_token is None and self._module_flops_per_batch is None:
            rank_zero_info("TokenThroughputMonitor: no model config or flops_per_token given, so no TFLOP/s or MFU.")
        self._totals.zero_()
        self._step_tokens, self._step_host_counts, self._unread = 0.0, [0.0, 0.0], []
        assert self._clock is not None
        self._clock.start()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        counts = self.tokens_fn(batch)
        self._step_tokens = self._step_tokens + counts.real_tokens
        self._step_host_counts[0] += counts.samples
        self._step_host_counts[1] += self._batch_flops(counts)
        # the test Lightning's ThroughputMonitor uses: a micro-batch that ends no optimizer step is only counted
        if lightning_internals.should_accumulate(trainer):
            return
        assert self._clock is not None
        self._clock.mark()
        self._unread.append([self._step_tokens, *self._step_host_counts])
        self._step_tokens, self._step_host_counts = 0.0, [0.0, 0.0]
        if is_reading_step(trainer):
            self._read_steps(trainer)
            self._log(trainer, pl_module)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._read_steps(trainer)  # every rank ends training together: the last steps count in the totals too

    def _read_steps(self, trainer: Trainer) -> None:
        """Sum the unread steps over the ranks (one all-reduce) and feed them to the rates in order."""
        assert self._clock is not None
        times = self._clock.read()
        unread, self._unread = self._unread, []
        if not unread:
            return
        reduced = collectives.all_reduce(_as_rows(unread, collectives.collective_device())).tolist()
        for (tokens, samples, flops), elapsed in zip(reduced, times, strict=True):
            self._totals += torch.tensor([tokens, samples, 1.0], dtype=torch.float64)
            self._update(trainer, elapsed, flops)

    def _batch_flops(self, counts: BatchTokens) -> float:
        if self.flops_per_token is not None:
            return self.flops_per_token * counts.samples * (counts.input_positions + (counts.target_positions or 0))
        if self.shape is not None:
            return training_flops(self.shape, counts.samples, counts.input_positions, counts.target_positions)
        return float(self._module_flops_per_batch or 0.0)

    def _update(self, trainer: Trainer, elapsed: float, global_flops: float) -> None:
        assert self._throughput is not None
        world = trainer.world_size
        tokens, samples, steps = (float(v) for v in self._totals)
        # Throughput takes per-device totals and multiplies by the world size: hand it the mean over ranks.
        self._throughput.update(
            time=elapsed,
            batches=int(steps),
            samples=samples / world,
            lengths=tokens / world,
            flops=(global_flops / world) if global_flops else None,
        )

    def _log(self, trainer: Trainer, pl_module: LightningModule) -> None:
        assert self._throughput is not None
        raw = self._throughput.compute()
        if "device/items_per_sec" not in raw:
            return  # the window is not full yet
        world = trainer.world_size
        metrics = {
            "throughput/tokens_per_sec": raw["device/items_per_sec"] * world,
            "throughput/device/tokens_per_sec": raw["device/items_per_sec"],
            "throughput/samples_per_sec": raw["device/samples_per_sec"] * world,
        }
        if "device/flops_per_sec" in raw:
            metrics["throughput/device/tflops_per_sec"] = raw["device/flops_per_sec"] / 1e12
        if "device/mfu" in raw:
            metrics["throughput/device/mfu"] = raw["device/mfu"]
        if self.traffic is not None:
            metrics["comm/inter_node_bytes_per_step"] = self.traffic.inter_node_bytes
            metrics["comm/intra_node_bytes_per_step"] = self.traffic.intra_node_bytes
        pl_module.log("tokens/s", metrics["throughput/tokens_per_sec"], prog_bar=True, logger=False, batch_size=1)
        pl_module.log_dict(metrics, batch_size=1)
        self.history.append({"step": trainer.global_step, "time": raw["time"], **metrics})


def _as_rows(steps: list[list[Any]], device: torch.device) -> torch.Tensor:
    """(steps, 3) float64 on ``device``: each step's tokens (a device tensor or a number), samples and FLOPs."""
    return torch.stack([torch.stack([torch.as_tensor(v, dtype=torch.float64).to(device) for v in s]) for s in steps])


def _count_on_device(batch: Any) -> BatchTokens:
    return _detect_batch_tokens(batch, on_device=True)


def _module_config(pl_module: LightningModule) -> Optional[Any]:
    """A transformers config on the module or its ``model`` (the usual ways to wrap a Hugging Face model)."""
    for owner in (pl_module, getattr(pl_module, "model", None)):
        config = getattr(owner, "config", None)
        if hasattr(config, "to_dict"):
            return config
    return None
