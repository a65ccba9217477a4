"""``TrainingSummary``: a few lines at the end of training: loss at start and end, perplexity, tokens/s, checkpoint."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only


def summarize(losses: list[float], tokens: int, seconds: float, tail: int = 10) -> dict[str, float]:
    """First loss, mean loss of the last ``tail`` steps, and throughput."""
    last = losses[-tail:]
    return {
        "first_loss": losses[0],
        "last_loss": sum(last) / len(last),
        "steps": len(losses),
        "tokens_per_second": tokens / seconds if seconds > 0 else float("nan"),
    }


class TrainingSummary(L.Callback):
    """Print (rank 0) how training went; optionally also write it as JSON to ``summary_file``.

    Tokens/s counts the input tokens of all ranks over the training time, validation included.
    """

    def __init__(self, summary_file: Optional[str] = None, tail: int = 10) -> None:
        self.summary_file = summary_file
        self.tail = tail
        self.losses: list[float] = []
        self.tokens = 0
        self.started = 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.started = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self.losses.append(float(loss.detach()))
        self.tokens += int(batch["input_ids"].numel()) * trainer.world_size

    @rank_zero_only
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.losses:
            return
        summary: dict[str, Any] = summarize(self.losses, self.tokens, time.perf_counter() - self.started, self.tail)
        perplexity = trainer.callback_metrics.get("val_perplexity")
        summary["val_perplexity"] = float(perplexity) if perplexity is not None else None
        checkpoint = trainer.checkpoint_callback
        summary["checkpoint"] = (checkpoint.last_model_path or checkpoint.best_model_path) if checkpoint else None
        summary["export_dir"] = getattr(pl_module, "hparams", {}).get("export_dir")
        print(self.format(summary))
        if self.summary_file:
            Path(self.summary_file).parent.mkdir(parents=True, exist_ok=True)
            Path(self.summary_file).write_text(json.dumps(summary, indent=2))

    def format(self, summary: dict[str, Any]) -> str:
        perplexity = summary["val_perplexity"]
        lines = [
            f"training summary ({summary['steps']} steps)",
            f"  loss            {summary['first_loss']:.3f} (first step) -> {summary['last_loss']:.3f} "
            f"(mean of last {min(self.tail, summary['steps'])})",
            f"  val perplexity  {perplexity:.2f}" if perplexity is not None else "  val perplexity  (no validation)",
            f"  throughput      {summary['tokens_per_second']:,.0f} tokens/s (all ranks)",
            f"  checkpoint      {summary['checkpoint'] or '(none saved)'}",
        ]
        if summary.get("export_dir"):
            lines.append(f"  exported to     {summary['export_dir']} (Hugging Face model + tokenizer)")
        return "\n".join(lines)
