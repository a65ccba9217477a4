"""A tiny token model trained under HpzStrategy with lightning_hpz's callbacks, launched as a script.

Run as ``python callback_training.py '<json options>'``; Lightning's launcher re-executes it once per extra rank.
Rank 0 writes ``result.json`` into ``out`` with what the tests assert on: per-step losses, the full (gathered) weights
after every step and before the step that returns NaN, the monitor's records and the throughput monitor's metrics.
"""

import json
import math
import sys
import time
from pathlib import Path

import deepspeed
import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_hpz
from lightning_hpz.callbacks import LossStabilityMonitor, TokenThroughputMonitor, step_clock

VOCAB, SEQ, PAD = 64, 16, 0
TINY_ZERO3 = {
    "zero_optimization": {
        "stage3_max_live_parameters": 0,
        "stage3_max_reuse_distance": 0,
        "stage3_param_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": 0,
    }
}


class PaddedTokens(Dataset):
    """Token sequences of random real length (4..SEQ), right-padded, with an attention mask."""

    def __init__(self, size: int = 512) -> None:
        generator = torch.Generator().manual_seed(7)
        self.lengths = torch.randint(4, SEQ + 1, (size,), generator=generator)
        self.ids = torch.randint(1, VOCAB, (size, SEQ), generator=generator)
        self.mask = (torch.arange(SEQ)[None, :] < self.lengths[:, None]).long()
        self.ids = self.ids * self.mask

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "attention_mask": self.mask[index]}


class TinyLanguageModel(L.LightningModule):
    def __init__(self, nan_at_step: int = -1) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, VOCAB))
        self.nan_at_step = nan_at_step
        self.losses: dict[int, float] = {}
        self.real_tokens_per_step: list[int] = []

    def training_step(self, batch, batch_idx):
        ids, mask = batch["input_ids"], batch["attention_mask"]
        logits = self.mlp(self.embed(ids[:, :-1]))  # (B, T-1, V)
        targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)
        if self.global_step == self.nan_at_step:
            loss = loss * float("nan")
        self.losses[self.global_step] = loss.item()
        self.real_tokens_per_step.append(int(mask.sum()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)


def full_weights(module: nn.Module) -> list[float]:
    """Every parameter gathered from its shards (a collective: all ranks call), flattened."""
    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return torch.cat([p.detach().reshape(-1).float() for p in params]).tolist()


class WeightRecorder(L.Callback):
    """Full weights after every step, and before the step that returns NaN."""

    def __init__(self, nan_at_step: int) -> None:
        self.nan_at_step = nan_at_step
        self.after_step: dict[int, list[float]] = {}
        self.before_bad_step: list[float] = []
        self.loss_scaler_after_step: dict[int, list[float]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.nan_at_step:
            self.before_bad_step = full_weights(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after_step[trainer.global_step - 1] = full_weights(pl_module)
        scaler = getattr(trainer.strategy.deepspeed_engine.optimizer, "loss_scaler", None)
        if hasattr(scaler, "cur_hysteresis"):  # fp16's dynamic loss scaler, read straight from DeepSpeed
            fields = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
            self.loss_scaler_after_step[trainer.global_step - 1] = [getattr(scaler, name) for name in fields]


class MonitorClock:
    """The throughput monitor's clock, keeping every reading: the test divides by the very times it measured."""

    def __init__(self) -> None:
        self.readings: list[float] = []

    def perf_counter(self) -> float:
        self.readings.append(time.perf_counter())
        return self.readings[-1]


def main(options: dict) -> None:
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0, verbose=False)
    strategy = lightning_hpz.HpzStrategy(stage=3, hpz_partition_size=2, config=TINY_ZERO3)
    monitor = LossStabilityMonitor(
        action=options.get("action", "warn"),
        warmup=3,
        checkpoint_every_n_steps=options.get("checkpoint_every", 4),
        dirpath=str(out / "stability"),
    )
    throughput = TokenThroughputMonitor(flops_per_token=options.get("flops_per_token"), window_size=8)
    clock = MonitorClock()
    step_clock.time = clock  # read once at train start, then once at each optimizer step end
    recorder = WeightRecorder(options.get("nan_at_step", -1))
    callbacks = [monitor, throughput, recorder]
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=4,
        precision=options.get("precision", "32-true"),
        max_steps=options.get("steps", 12),
        callbacks=callbacks,
        logger=CSVLogger(out, name="logs", version=0),
        log_every_n_steps=options.get("log_every", 1),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = TinyLanguageModel(nan_at_step=options.get("nan_at_step", -1))
    data = DataLoader(PaddedTokens(), batch_size=options.get("batch_size", 8), shuffle=True)
    try:
        trainer.fit(model, data, ckpt_path=options.get("resume_from"))
        exit_code = 0
    except SystemExit as ended:  # LossStabilityMonitor(action="stop") ends fit with a documented exit code
        exit_code = ended.code
    final = full_weights(model)
    # (steps,) real tokens of every rank per step, counted by the model itself, not by the monitor
    real_tokens = trainer.strategy.reduce(
        torch.tensor(model.real_tokens_per_step, dtype=torch.float64), reduce_op="sum"
    )
    if trainer.global_rank != 0:
        sys.exit(exit_code)
    summary_file = out / "stability" / "stability_summary.json"
    record = {
        "exit_code": exit_code,
        "stability_summary": json.loads(summary_file.read_text()) if summary_file.is_file() else None,
        "engine_skipped_steps": trainer.strategy.deepspeed_engine.skipped_steps,
        "losses": {str(k): str(v) for k, v in model.losses.items()},
        "global_step": trainer.global_step,
        "final_weights_finite": all(math.isfinite(w) for w in final),
        "after_step": {str(k): v for k, v in recorder.after_step.items()},
        "before_bad_step": recorder.before_bad_step,
        "loss_scaler_after_step": {str(k): v for k, v in recorder.loss_scaler_after_step.items()},
        "rollbacks": monitor.rollbacks,
        "skipped": monitor.skipped,
        "stop_checkpoint": monitor.stop_checkpoint,
        "good_checkpoint_step": monitor.good_checkpoint_step,
        "real_tokens_per_step": real_tokens.tolist(),
        "batch_end_times": clock.readings[1:],
        "throughput": throughput.history,
        "traffic": None if throughput.traffic is None else vars(throughput.traffic),
        "parameters": sum(p.ds_numel for p in model.parameters()),
    }
    (out / "result.json").write_text(json.dumps(record))
    sys.exit(exit_code)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
