"""``TrainingSummary``: a few lines at the end of training: loss at start and end, perplexity, tokens/s, checkpoint."""

from __future__ import annotations

import json
import os
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
    """Print (rank 0) how training went and write it as ``summary.json`` into the run's own log directory.

    Every run writes into its own version directory (``trainer.log_dir``), so runs of one config never overwrite
    each other. ``summary_file``, if given, becomes a link to the newest run's summary. A run that ends early says
    why: ``status`` is ``completed``, ``preempted``, ``stopped`` (instability) or ``failed``, with ``reason``.
    Tokens/s counts the input tokens of all ranks over the training time, validation included.
    """

    def __init__(self, summary_file: Optional[str] = None, tail: int = 10) -> None:
        self.summary_file = summary_file
        self.tail = tail
        self.losses: list[float] = []
        self.tokens = 0
        self.started = 0.0
        self.written: Optional[Path] = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.started = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self.losses.append(float(loss.detach()))
        ids = batch.get("input_ids") if isinstance(batch, dict) else None
        if isinstance(ids, torch.Tensor):  # token counts only where the batch says what its tokens are
            self.tokens += int(ids.numel()) * trainer.world_size

    @rank_zero_only
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._finish(trainer, "completed", None, None)

    @rank_zero_only
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        status = getattr(exception, "status", "failed")
        self._finish(
            trainer, status, str(exception) or type(exception).__name__, getattr(exception, "checkpoint", None)
        )

    def _finish(self, trainer: L.Trainer, status: str, reason: Optional[str], checkpoint: Optional[str]) -> None:
        summary: dict[str, Any] = {"status": status, "reason": reason, "global_step": trainer.global_step}
        if self.losses:
            summary.update(summarize(self.losses, self.tokens, time.perf_counter() - self.started, self.tail))
        perplexity = trainer.callback_metrics.get("val_perplexity")
        summary["val_perplexity"] = float(perplexity) if perplexity is not None else None
        callback = trainer.checkpoint_callback
        summary["checkpoint"] = checkpoint or (
            (callback.last_model_path or callback.best_model_path) if callback else None
        )
        self.written = self._write(trainer, summary)
        summary["summary_file"] = str(self.written)
        summary["export_dir"] = (getattr(trainer.lightning_module, "hparams", None) or {}).get("export_dir")
        print(self.format(summary))

    def _write(self, trainer: L.Trainer, summary: dict[str, Any]) -> Path:
        run_file = _run_directory(trainer) / "summary.json"
        run_file.parent.mkdir(parents=True, exist_ok=True)
        run_file.write_text(json.dumps(summary, indent=2))
        if self.summary_file:
            _point_link_at(Path(self.summary_file), run_file)
        return run_file

    def format(self, summary: dict[str, Any]) -> str:
        lines = [f"training summary ({summary.get('steps', 0)} steps, {summary['status']})"]
        if "first_loss" in summary:
            lines.append(
                f"  loss            {summary['first_loss']:.3f} (first step) -> {summary['last_loss']:.3f} "
                f"(mean of last {min(self.tail, summary['steps'])})"
            )
        perplexity = summary["val_perplexity"]
        lines.append(
            f"  val perplexity  {perplexity:.2f}" if perplexity is not None else "  val perplexity  (no validation)"
        )
        if summary.get("tokens_per_second"):
            lines.append(f"  throughput      {summary['tokens_per_second']:,.0f} tokens/s (all ranks)")
        lines.append(f"  checkpoint      {summary['checkpoint'] or '(none saved)'}")
        lines.append(f"  summary         {summary['summary_file']}")
        if summary["reason"]:
            lines.append(f"  ended early     {summary['reason']}")
        if summary.get("export_dir"):
            lines.append(f"  exported to     {summary['export_dir']} (Hugging Face model + tokenizer)")
        return "\n".join(lines)


def _run_directory(trainer: L.Trainer) -> Path:
    """The run's own log directory, read on this rank alone: ``trainer.log_dir`` broadcasts (a collective), and the
    summary is written by rank 0 only, also from ``on_exception`` while other ranks may be gone."""
    logger = trainer.logger
    if logger is None:
        return Path(trainer.default_root_dir)
    return Path(getattr(logger, "log_dir", None) or logger.save_dir or trainer.default_root_dir)


def _point_link_at(link: Path, target: Path) -> None:
    """Make ``link`` a symbolic link to ``target``, replaced atomically (concurrent runs race harmlessly)."""
    if link.resolve() == target.resolve():
        return
    link.parent.mkdir(parents=True, exist_ok=True)
    temporary = link.with_name(f".{link.name}.{os.getpid()}")
    temporary.unlink(missing_ok=True)
    temporary.symlink_to(os.path.relpath(target.resolve(), link.parent.resolve()))
    os.replace(temporary, link)
