"""hpZ combined with the features that change what a gather or a backward does, launched as a script (one per rank).

Run as ``python hpz_combinations.py '<json options>'``: ``options["cases"]`` maps a case name to its settings, trained
one after the other in the same processes under one hpZ size (DeepSpeed's secondary process group is global). A case
trains a small language model for ``steps`` optimizer steps under ZeRO-3; its settings switch on frozen LoRA-style
base weights, an output layer tied to the embedding, activation checkpointing (reentrant or not), bf16 and gradient
accumulation. Each rank writes ``rank<r>.json`` into ``out``: per case, the loss of every training batch and the
most secondary partitions seen after a forward.
"""

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

import lightning_hpz
from lightning_hpz.partitioning import count_secondary_partitions

VOCABULARY, WIDTH, RANK, LENGTH = 64, 32, 4, 16


def token_data(samples: int = 256) -> TensorDataset:
    """Token sequences whose next token follows from the current one, the same on every rank."""
    generator = torch.Generator().manual_seed(1234)
    start = torch.randint(0, VOCABULARY, (samples, 1), generator=generator)
    tokens = (start + 3 * torch.arange(LENGTH + 1)) % VOCABULARY  # (N, T+1)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


class LowRankLinear(nn.Module):
    """A linear layer with a LoRA-style adapter: ``base`` may be frozen while ``down``/``up`` train."""

    def __init__(self, width: int, frozen: bool) -> None:
        super().__init__()
        self.base = nn.Linear(width, width)
        self.down, self.up = nn.Linear(width, RANK, bias=False), nn.Linear(RANK, width, bias=False)
        self.base.requires_grad_(not frozen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


class Block(nn.Module):
    def __init__(self, frozen: bool) -> None:
        super().__init__()
        self.norm, self.inner, self.outer = nn.LayerNorm(WIDTH), LowRankLinear(WIDTH, frozen), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.outer(nn.functional.gelu(self.inner(self.norm(x))))


class CombinationModel(L.LightningModule):
    """Embedding, two residual blocks, output layer; each feature is one setting."""

    def __init__(self, frozen=False, tied=False, checkpointing=None) -> None:
        super().__init__()
        self.frozen, self.tied, self.checkpointing = frozen, tied, checkpointing
        self.layers = None
        self.losses: list[float] = []
        self.most_secondaries = 0  # hpZ's secondary copies alive after a forward: hpZ > 1 really used them

    def configure_model(self) -> None:
        if self.layers is not None:
            return
        self.embed = nn.Embedding(VOCABULARY, WIDTH)
        self.layers = nn.ModuleList(Block(self.frozen) for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCABULARY, bias=False)
        if self.tied:
            self.head.weight = self.embed.weight
        if self.frozen:
            self.embed.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # (B, T, C)
        for block in self.layers:
            if self.checkpointing is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.checkpointing == "reentrant")
        if self.tied:
            x = x * WIDTH**-0.5  # as T5 does before a head tied to the embedding, whose entries are N(0, 1)
        return self.head(x)  # (B, T, vocab)

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        loss = nn.functional.cross_entropy(self(tokens).flatten(0, 1).float(), targets.flatten())
        self.losses.append(loss.item())
        self.most_secondaries = max(self.most_secondaries, count_secondary_partitions(self))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def run_case(case: dict, options: dict) -> dict:
    L.seed_everything(0, verbose=False)
    strategy = lightning_hpz.HpzStrategy(**options["strategy"])
    model = CombinationModel(case.get("frozen", False), case.get("tied", False), case.get("checkpointing"))
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=4,
        max_steps=options["steps"],
        precision=case.get("precision", "32-true"),
        accumulate_grad_batches=case.get("accumulate", 1),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(token_data(), batch_size=4, shuffle=True))
    return {"losses": model.losses, "most_secondaries": model.most_secondaries}


def main(options: dict) -> None:
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    record = {name: run_case(case, options) for name, case in options["cases"].items()}
    (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps({"cases": record}))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
