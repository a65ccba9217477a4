"""TokenThroughputMonitor updates and logs once per optimizer step under gradient accumulation, as Lightning's
ThroughputMonitor does, while counting the tokens and samples of every micro-batch."""

import lightning as L
from test_callbacks_single_device import PaddedTokens, TinyModel
from torch.utils.data import DataLoader

from lightning_hpz.callbacks import TokenThroughputMonitor

ACCUMULATE, BATCH, STEPS, WINDOW = 4, 8, 6, 2


def test_one_log_per_optimizer_step_with_accumulate_grad_batches_4(tmp_path):
    L.seed_everything(0, verbose=False)
    monitor = TokenThroughputMonitor(flops_per_token=6.0, window_size=WINDOW)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=STEPS, accumulate_grad_batches=ACCUMULATE, log_every_n_steps=1,
        callbacks=[monitor], default_root_dir=tmp_path, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = PaddedTokens()
    trainer.fit(TinyModel(), DataLoader(data, batch_size=BATCH))
    micro_batches = STEPS * ACCUMULATE
    # the rates need WINDOW updates, then every optimizer step logs exactly once
    assert [entry["step"] for entry in monitor.history] == list(range(WINDOW, STEPS + 1))
    tokens, samples, steps = monitor._totals.tolist()
    assert (samples, steps) == (micro_batches * BATCH, STEPS)
    assert tokens == data.mask[: micro_batches * BATCH].sum().item()
