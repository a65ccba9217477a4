"""Cells of the resume-equivalence matrix, trained under HpzStrategy, launched as a script (one process per rank).

Run as ``python resume_matrix.py '<json options>'``. ``options["cells"]`` is a list of trainings run one after the
other in the same processes (all with one hpZ size: DeepSpeed's secondary process group is global). A cell without
``resume_from`` trains ``steps`` optimizer steps from scratch and checkpoints on the way; with it, a fresh Trainer and
module resume from that checkpoint to ``steps``. Each rank writes ``rank<r>.json``: per cell, the loss and learning
rate of every batch it trained, keyed by ``epoch:batch_idx``.
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos import Transformer
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import lightning_hpz
from lightning_hpz.models import Llama2

SEQUENCE = 12
VOCAB = 96  # also within the llama2-tiny vocabulary


# ----------------------------------------------------------------------------------------------- optimizers
def configure_optimizer(parameters, kind: str):
    """The optimizer side of a cell, as ``configure_optimizers`` returns it (``None``: the DeepSpeed config has it)."""
    if kind == "adamw":
        return torch.optim.AdamW(parameters, lr=3e-3, weight_decay=0.01)
    if kind == "sgd_steplr":  # an epoch-interval scheduler: Lightning steps it after on_train_epoch_end
        optimizer = torch.optim.SGD(parameters, lr=0.05, momentum=0.9)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)}
    if kind == "sgd_lambdalr":
        optimizer = torch.optim.SGD(parameters, lr=0.05, momentum=0.9)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + 0.3 * step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
    if kind == "deepspeed":
        return None
    raise ValueError(kind)


DEEPSPEED_OPTIMIZER = {
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01, "torch_adam": True}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 6}},
}


# ----------------------------------------------------------------------------------------------- modules
class ResidualBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class ResidualRegressor(L.LightningModule):
    """The issue's module: Linear embed, four pre-norm MLP blocks, Linear head, MSE loss."""

    def __init__(self, optimizer: str = "adamw", features: int = 16, width: int = 32) -> None:
        super().__init__()
        self.optimizer_kind = optimizer
        self.embed = nn.Linear(features, width)
        self.blocks = nn.Sequential(*[ResidualBlock(width) for _ in range(4)])
        self.head = nn.Linear(width, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.head(self.blocks(self.embed(x))), y)

    def configure_optimizers(self):
        return configure_optimizer(self.parameters(), self.optimizer_kind)


class LightningTransformer(L.LightningModule):
    """Lightning's own demo Transformer, as its docs wrap it (dropout off: a checkpoint keeps no RNG state)."""

    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__()
        self.optimizer_kind = optimizer
        self.model = Transformer(vocab_size=VOCAB, ninp=32, nhead=2, nhid=64, nlayers=2, dropout=0.0)

    def training_step(self, batch, batch_idx):
        tokens, target = batch
        output = self.model(tokens, target)
        return nn.functional.nll_loss(output, target.view(-1))

    def configure_optimizers(self):
        return configure_optimizer(self.parameters(), self.optimizer_kind)


class TinyLlama(Llama2):
    """The package's Llama-2 tiny preset, with the cell's optimizer instead of its own warmup-cosine AdamW."""

    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__(preset="llama2-tiny")
        self.optimizer_kind = optimizer

    def configure_optimizers(self):
        return configure_optimizer(self.model.parameters(), self.optimizer_kind)


class TokenDicts(Dataset):
    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int):
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def module_and_data(kind: str, optimizer: str, options: dict) -> tuple[L.LightningModule, DataLoader]:
    samples = options["samples"]
    generator = torch.Generator().manual_seed(1234)
    if kind == "mlp":
        x = torch.randn(samples, 16, generator=generator)
        data = TensorDataset(x, torch.tanh(x @ torch.randn(16, 1, generator=generator)))
        module = ResidualRegressor(optimizer)
    elif kind == "transformer":
        tokens = torch.randint(0, VOCAB, (samples, SEQUENCE + 1), generator=generator)
        data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
        module = LightningTransformer(optimizer)
    elif kind == "llama2":
        data = TokenDicts(torch.randint(0, VOCAB, (samples, SEQUENCE), generator=generator))
        module = TinyLlama(optimizer)
    else:
        raise ValueError(kind)
    return module, DataLoader(data, batch_size=options["batch_size"], shuffle=options.get("shuffle", False))


# ----------------------------------------------------------------------------------------------- recording
class BatchRecorder(L.Callback):
    """The loss and learning rate of every batch trained, keyed by where it sits in the run."""

    def __init__(self) -> None:
        self.record: dict[str, list[float]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        learning_rate = trainer.optimizers[0].param_groups[0]["lr"]
        self.record[f"{trainer.current_epoch}:{batch_idx}"] = [float(outputs["loss"]), float(learning_rate)]


def checkpoint_callback(cell: dict, out: Path) -> ModelCheckpoint:
    dirpath = out / cell["name"]
    if cell["checkpoint"] == "epoch_end":
        return ModelCheckpoint(dirpath=dirpath, every_n_epochs=1, save_on_train_epoch_end=True, save_top_k=-1)
    return ModelCheckpoint(dirpath=dirpath, every_n_train_steps=cell["checkpoint_step"], save_top_k=-1)


VERIFIED_IN_LOAD: dict[str, list] = {}


def run_cell(cell: dict, options: dict, out: Path) -> dict:
    L.seed_everything(0, verbose=False)
    config = DEEPSPEED_OPTIMIZER if cell["optimizer"] == "deepspeed" else None
    strategy = lightning_hpz.HpzStrategy(**options["strategy"], config=config)
    module, data = module_and_data(cell["module"], cell["optimizer"], options)
    recorder = BatchRecorder()
    resuming = cell.get("resume_from") is not None
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=options["devices"],
        max_steps=cell["steps"],
        accumulate_grad_batches=cell["accumulate"],
        use_distributed_sampler=options.get("use_distributed_sampler", True),
        callbacks=[recorder] if resuming else [recorder, checkpoint_callback(cell, out)],
        logger=False,
        enable_checkpointing=not resuming,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, data, ckpt_path=cell.get("resume_from"))
    if resuming:  # the checkpoint files DeepSpeed read, each verified from the bytes it loaded
        VERIFIED_IN_LOAD[cell["name"]] = getattr(trainer.strategy, "files_verified_in_load", None)
    return recorder.record


def main(options: dict) -> None:
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    records = {cell["name"]: run_cell(cell, options, out) for cell in options["cells"]}
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    (out / f"rank{rank}.json").write_text(json.dumps({"cells": records, "verified_in_load": VERIFIED_IN_LOAD}))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
