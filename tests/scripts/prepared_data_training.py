"""Lightning's demo Transformer trained on a prepared corpus under HpzStrategy, as a script (one process per rank).

Run as ``python prepared_data_training.py '<json options>'``. Options: ``data`` (CausalLMDataModule arguments, e.g.
``source``: a prepared directory), ``steps``, ``devices``, ``checkpoint_at`` (a step to checkpoint at),
``resume_from``. Each rank writes ``rank<r>.json``: its losses per step and the sample indices it trained on.
"""

import json
import resource
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.demos import Transformer

import lightning_hpz
from lightning_hpz.data import CausalLMDataModule


class DemoLanguageModel(L.LightningModule):
    """Lightning's own demo Transformer, not one of lightning_hpz's models, trained for next-token prediction.

    No dropout: Lightning's checkpoints do not hold the RNG state, and this run checks the data order, not that.
    """

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.model = Transformer(vocab_size=vocab_size, ninp=32, nhead=2, nhid=64, nlayers=1, dropout=0.0)
        self.losses: dict[int, float] = {}
        self.samples: dict[int, list[int]] = {}
        self.fit_called = time.perf_counter()
        self.first_batch_seconds = None

    def training_step(self, batch, batch_idx):
        if self.first_batch_seconds is None:  # process group, data setup, DeepSpeed engine, first (resumed) batch
            self.first_batch_seconds = time.perf_counter() - self.fit_called
        tokens = batch["input_ids"]
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        logits = self.model(inputs, targets)  # (B, T, vocab)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        self.losses[self.global_step] = loss.item()
        self.samples[self.global_step] = batch["sample_index"].tolist()
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class CheckpointAt(L.Callback):
    """Save a checkpoint after step ``step`` (mid-epoch) and keep training, so one run gives both the checkpoint and
    the uninterrupted losses to compare a resume with."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def main(options: dict) -> None:
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0, verbose=False)
    data = CausalLMDataModule(**options["data"])
    callbacks = [CheckpointAt(options["checkpoint_at"], out / "mid_epoch.ckpt")] if options.get("checkpoint_at") else []
    trainer = L.Trainer(
        strategy=lightning_hpz.HpzStrategy(stage=3, hpz_partition_size=options.get("hpz", 1)),
        accelerator="cpu",
        devices=options.get("devices", 2),
        max_steps=options["steps"],
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    model = DemoLanguageModel(data.vocab_size)
    model.fit_called = time.perf_counter()
    trainer.fit(model, data, ckpt_path=options.get("resume_from"))
    record = {
        "losses": {str(k): v for k, v in model.losses.items()},
        "samples": {str(k): v for k, v in model.samples.items()},
        "batches_per_epoch": len(trainer.train_dataloader),
        "first_batch_seconds": model.first_batch_seconds,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # what the benchmark reads
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
