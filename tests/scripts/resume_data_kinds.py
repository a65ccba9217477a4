"""Resume from training data that is not one map-style DataLoader read in order, under HpzStrategy (ZeRO 2).

Run as ``python resume_data_kinds.py '<json options>'`` (one process per rank). Each entry of ``options["cases"]`` is
a training run in the same processes, from scratch with a checkpoint every ``checkpoint_step`` steps, or (with
``resume_from``) resumed from one of those checkpoints to ``steps``:

- ``iterable``: an ``IterableDataset`` that yields this rank's share of a seeded stream;
- ``two_loaders``: two training DataLoaders, the second a third as long (Lightning restarts it when it runs out);
- ``shuffled_workers``: a shuffled DataLoader (Lightning's distributed sampler) read by 2 worker processes.

Each rank writes ``rank<r>.json``: per case, the loss of every batch trained, keyed by ``epoch:batch_idx``.
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import lightning_hpz

FEATURES = 8


def examples(count: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(count, FEATURES, generator=generator)
    return TensorDataset(x, x.sin().sum(dim=1, keepdim=True))


class RankStream(IterableDataset):
    """A seeded stream of examples, each rank taking every ``world``-th; the same sequence at every pass."""

    def __init__(self, count: int) -> None:
        self.data = examples(count, seed=11)

    def __iter__(self):
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        for index in range(rank, len(self.data), world):
            yield self.data[index]


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        pairs = batch if isinstance(batch, list) and isinstance(batch[0], list) else [batch]  # one per loader
        return sum((self.net(x) - y).pow(2).mean() for x, y in pairs)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def train_data(kind: str):
    if kind == "iterable":
        return DataLoader(RankStream(64), batch_size=4)
    if kind == "two_loaders":
        return [DataLoader(examples(64, seed=12), batch_size=4), DataLoader(examples(24, seed=13), batch_size=4)]
    if kind == "shuffled_workers":
        return DataLoader(examples(64, seed=14), batch_size=4, shuffle=True, num_workers=2)
    raise ValueError(kind)


class BatchRecorder(L.Callback):
    def __init__(self) -> None:
        self.record: dict[str, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.record[f"{trainer.current_epoch}:{batch_idx}"] = float(outputs["loss"])


def run_case(case: dict, options: dict, out: Path) -> dict:
    L.seed_everything(0, verbose=False)
    recorder = BatchRecorder()
    resuming = case.get("resume_from") is not None
    saving = ModelCheckpoint(dirpath=out / case["kind"], every_n_train_steps=case["checkpoint_step"], save_top_k=-1)
    trainer = L.Trainer(
        strategy=lightning_hpz.HpzStrategy(stage=2),
        accelerator="cpu",
        devices=options["devices"],
        max_steps=case["steps"],
        callbacks=[recorder] if resuming else [recorder, saving],
        logger=False,
        enable_checkpointing=not resuming,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(), train_data(case["kind"]), ckpt_path=case.get("resume_from"))
    return recorder.record


def main(options: dict) -> None:
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    records = {case["kind"]: run_case(case, options, out) for case in options["cases"]}
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    (out / f"rank{rank}.json").write_text(json.dumps({"cases": records}))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
