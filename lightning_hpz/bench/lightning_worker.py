"""One rank of a benchmark configuration trained by a Lightning Trainer with :class:`~lightning_hpz.HpzStrategy`.

Started by torchrun (Lightning detects it through ``TorchElasticEnvironment``), with ``num_nodes=2`` and
``devices=<devices per node>``; the step times and link counters come from a callback at each batch end.
A spec's ``"strategy_kwargs"`` replace the configuration's :class:`~lightning_hpz.HpzStrategy` arguments (the autotune
benchmark runs the tuner and each of its candidates this way); a tuned strategy's decision goes into the record. A spec
with ``"runs"`` (each entry its own ``"strategy_kwargs"`` and ``"out"``) trains once per entry, one after the other in
the same processes: a new Trainer and strategy each time, the process group and the start-up cost shared.
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from lightning_hpz.bench.configurations import BenchConfiguration
from lightning_hpz.bench.recording import StepRecorder
from lightning_hpz.bench.workload import Workload, build_model, rank_loader, token_set


class BenchLanguageModel(L.LightningModule):
    """The benchmark model as an ordinary LightningModule (built in ``__init__``, so every rank starts equal)."""

    def __init__(self, workload: Workload) -> None:
        super().__init__()
        self.workload = workload
        self.model = build_model(workload)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.workload.learning_rate)


class StepRecording(Callback):
    """Hands each finished step (its loss, the time) to a :class:`StepRecorder`; keeps the autotune decision."""

    def __init__(self, steps: int, warmup: int) -> None:
        self.steps = steps
        self.warmup = warmup
        self.recorder: StepRecorder | None = None
        self.autotune_decision: dict[str, Any] | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.recorder = StepRecorder(self.steps, self.warmup)
        # Read while the engine exists: the decision is made when it is built.
        decision = getattr(trainer.strategy, "autotune_decision", None)
        self.autotune_decision = decision.to_dict() if decision is not None else None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        assert self.recorder is not None
        self.recorder.step_done(outputs["loss"].item())


def strategy_kwargs(spec: dict[str, Any], configuration: BenchConfiguration) -> dict[str, Any]:
    """The spec's own ``"strategy_kwargs"`` where it has them (all of them, none merged), else the configuration's."""
    if "strategy_kwargs" in spec:
        return dict(spec["strategy_kwargs"])
    return configuration.strategy_kwargs(spec["devices_per_node"])


def run(spec: dict[str, Any], configuration: BenchConfiguration, workload: Workload) -> None:
    """Train once, or once per entry of ``spec["runs"]`` (entries override the spec's keys)."""
    for entry in spec.get("runs", [{}]):
        train(spec | entry, configuration, workload)
        gc.collect()  # drop the finished engine before the next one is built


def train(spec: dict[str, Any], configuration: BenchConfiguration, workload: Workload) -> None:
    import lightning_hpz

    devices = spec["devices_per_node"]
    L.seed_everything(workload.seed, verbose=False)
    strategy = lightning_hpz.HpzStrategy(**strategy_kwargs(spec, configuration))
    recording = StepRecording(spec["steps"], spec["warmup"])
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        num_nodes=2,
        max_steps=spec["steps"],
        callbacks=[recording],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    # Each rank reads exactly the batches the hand-written loops read (Lightning's own sampler would shuffle).
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    data = rank_loader(token_set(workload, spec["steps"], world), workload, rank, world)
    trainer.fit(BenchLanguageModel(workload), data)
    assert recording.recorder is not None
    extra: dict[str, Any] = {"deepspeed_config": json.loads(json.dumps(strategy.config, default=str))}
    if recording.autotune_decision is not None:
        extra["autotune_decision"] = recording.autotune_decision
    recording.recorder.write(Path(spec["out"]), **extra)
