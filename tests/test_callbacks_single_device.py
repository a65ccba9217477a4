"""The callbacks under a plain single-device Trainer (no DeepSpeed): skip, rollback, spikes, throughput."""

import json
import math

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_hpz.callbacks import LossStabilityMonitor, TokenThroughputMonitor
from lightning_hpz.callbacks.model_flops import shape_from_config, training_flops
from lightning_hpz.lifecycle.run_exit import UNSTABLE_EXIT_CODE, TrainingStopped

VOCAB, SEQ = 96, 12


class PaddedTokens(Dataset):
    def __init__(self, size: int = 256) -> None:
        generator = torch.Generator().manual_seed(3)
        lengths = torch.randint(3, SEQ + 1, (size,), generator=generator)
        self.mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
        self.ids = torch.randint(1, VOCAB, (size, SEQ), generator=generator) * self.mask

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "attention_mask": self.mask[index]}


class TinyModel(L.LightningModule):
    """An embedding MLP language model; ``scale_at`` multiplies the loss at chosen steps (NaN, spikes)."""

    def __init__(self, scale_at: dict[int, float] | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, VOCAB))
        self.scale_at = scale_at or {}

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        logits = self.net(ids[:, :-1])
        targets = ids[:, 1:].masked_fill(batch["attention_mask"][:, 1:] == 0, -100)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)
        return loss * self.scale_at.get(self.global_step, 1.0)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class WeightsAfterEachStep(L.Callback):
    def __init__(self) -> None:
        self.after: dict[int, torch.Tensor] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after[trainer.global_step - 1] = torch.cat([p.detach().flatten().clone() for p in pl_module.parameters()])


def fit(tmp_path, model, callbacks, steps, log_every=1):
    L.seed_everything(0, verbose=False)
    quiet = dict(enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, logger=False)
    quiet["log_every_n_steps"] = log_every
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, callbacks=callbacks, default_root_dir=tmp_path, **quiet
    )
    trainer.fit(model, DataLoader(PaddedTokens(), batch_size=8, shuffle=True))
    return trainer


def test_skip_drops_the_update_of_the_nan_batch(tmp_path):
    monitor, weights = LossStabilityMonitor(action="skip", warmup=3), WeightsAfterEachStep()
    with pytest.warns(UserWarning, match=r"step 4: nonfinite_loss .* Action: skip_update\."):
        fit(tmp_path, TinyModel({4: math.nan}), [monitor, weights], steps=8)
    assert torch.equal(weights.after[4], weights.after[3])
    assert not torch.equal(weights.after[5], weights.after[4])
    assert [s["step"] for s in monitor.skipped] == [4]
    assert torch.isfinite(weights.after[7]).all()


def test_rollback_restores_weights_of_last_good_checkpoint(tmp_path):
    monitor = LossStabilityMonitor(action="rollback", warmup=3, checkpoint_every_n_steps=3)
    weights = WeightsAfterEachStep()
    with pytest.warns(UserWarning, match="Action: skip_update, rollback"):
        fit(tmp_path, TinyModel({7: math.inf}), [monitor, weights], steps=10)
    assert monitor.rollbacks == [{"step": 7, "restored_step": 6}]
    assert torch.equal(weights.after[7], weights.after[5])
    summary = json.loads((tmp_path / "stability" / "stability_summary.json").read_text())
    assert summary["nonfinite_losses"] == 1 and len(summary["rollbacks"]) == 1
    assert (tmp_path / "stability" / "loss_curve.png").is_file()


def test_loss_spike_is_skipped_and_a_clean_run_raises_nothing(tmp_path):
    spiky = LossStabilityMonitor(action="skip", warmup=5, z_threshold=6.0)
    with pytest.warns(UserWarning, match="step 12: loss_spike"):
        fit(tmp_path / "spiky", TinyModel({12: 30.0}), [spiky], steps=16)
    assert [(e.kind, e.step) for e in spiky.events] == [("loss_spike", 12)]
    clean = LossStabilityMonitor(action="stop", warmup=5)
    trainer = fit(tmp_path / "clean", TinyModel(), [clean], steps=16)
    assert clean.events == [] and trainer.global_step == 16


def test_stop_ends_training_with_exit_code_3_and_saves_a_checkpoint(tmp_path):
    monitor = LossStabilityMonitor(action="stop", warmup=3)
    with pytest.warns(UserWarning, match="Action: skip_update, stop"), pytest.raises(TrainingStopped) as stopped:
        fit(tmp_path, TinyModel({5: math.nan}), [monitor], steps=10)
    assert stopped.value.code == UNSTABLE_EXIT_CODE and "at step 5: nonfinite_loss" in str(stopped.value)
    assert stopped.value.checkpoint == monitor.stop_checkpoint
    assert monitor.stop_checkpoint is not None and torch.load(monitor.stop_checkpoint, weights_only=False)


class TinyLlama(L.LightningModule):
    """A Hugging Face model wrapped as ``self.model``: the monitor finds its config for the FLOP count."""

    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
        )
        self.model = transformers.LlamaForCausalLM(config)
        self.batches: list[tuple[int, int, int]] = []

    def training_step(self, batch, batch_idx):
        ids, mask = batch["input_ids"], batch["attention_mask"]
        self.batches.append((ids.shape[0], ids.shape[1], int(mask.sum())))
        return self.model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class StepClock(L.Callback):
    """A controlled clock: each step lasts a known, different time, so no wall-clock noise enters the assertions."""

    def __init__(self) -> None:
        self.now = 100.0
        self.times: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.now += 0.05 * (1 + batch_idx % 3)

    def on_train_batch_end(self, *args, **kwargs):
        self.times.append(self.now)


def test_throughput_counts_real_tokens_and_model_flops(tmp_path, monkeypatch):
    monitor, clock = TokenThroughputMonitor(window_size=6, peak_flops=1e12), StepClock()
    monkeypatch.setattr("lightning_hpz.callbacks.step_clock.time", clock)
    model = TinyLlama()
    fit(tmp_path, model, [monitor, clock], steps=8)
    last = monitor.history[-1]
    steps = last["step"]  # rates over the last 5 intervals, ending at this step
    window = model.batches[steps - 5 : steps]
    elapsed = clock.times[steps - 1] - clock.times[steps - 6]
    assert last["throughput/tokens_per_sec"] == pytest.approx(sum(b[2] for b in window) / elapsed, rel=1e-9)
    shape = shape_from_config(model.model.config)
    flops = sum(training_flops(shape, b[0], b[1]) for b in window)
    assert last["throughput/device/tflops_per_sec"] == pytest.approx(flops / elapsed / 1e12, rel=1e-9)
    assert last["throughput/device/mfu"] == pytest.approx(last["throughput/device/tflops_per_sec"], rel=1e-6)
    assert last["comm/inter_node_bytes_per_step"] == 0.0  # one device: nothing sent


def test_callbacks_run_with_logging_off(tmp_path):
    # log_every_n_steps=0 (Trainer(barebones=True), or logging off): the callbacks still read what the device holds
    monitor, throughput = LossStabilityMonitor(warmup=3), TokenThroughputMonitor(window_size=2)
    fit(tmp_path, TinyModel(), [monitor, throughput], steps=4, log_every=0)
    assert [step for step, _ in monitor.losses] == [0, 1, 2, 3]
    assert throughput.history == []  # nothing is logged when logging is off
