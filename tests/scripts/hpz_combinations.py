"""hpZ combined with the features that change what a gather or a backward does, launched as a script (one per rank).

Run as ``python hpz_combinations.py '<json options>'``: ``options["cases"]`` maps a case name to its settings, trained
one after the other in the same processes under one hpZ size (DeepSpeed's secondary process group is global). A case
trains a small language model for ``steps`` optimizer steps under ZeRO-3; its settings switch on frozen LoRA-style
base weights, an output layer tied to the embedding, activation checkpointing (reentrant or not), bf16, gradient
accumulation and an optimizer offloaded to the CPU. ``options["devices"]`` and ``options["num_nodes"]`` (4 and 1 unless
given) set the layout: several nodes are launched once per node with ``NODE_RANK``, as Lightning expects. Each rank
writes ``rank<r>.json`` into ``out``: per case, the loss of every training batch, the most secondary partitions seen
after a forward, and which optimizer stepped where.
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

import lightning_hpz
from lightning_hpz.partitioning import count_secondary_partitions
from lightning_hpz.strategy.config import merge_configs

VOCABULARY, WIDTH, RANK, LENGTH = 64, 32, 4, 16
OFFLOAD_OPTIMIZER = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}


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

    def __init__(self, frozen=False, tied=False, checkpointing=None, offload=False) -> None:
        super().__init__()
        self.frozen, self.tied, self.checkpointing, self.offload = frozen, tied, checkpointing, offload
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
        trained = [p for p in self.parameters() if p.requires_grad]
        if self.offload:  # DeepSpeed refuses a torch optimizer for an offloaded optimizer; the same AdamW, on the CPU
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(trained, lr=1e-2, weight_decay=1e-2, adamw_mode=True)
        return torch.optim.AdamW(trained, lr=1e-2)


def case_strategy(case: dict, options: dict) -> lightning_hpz.HpzStrategy:
    """The launch's strategy settings; an offloaded case adds ``offload_optimizer`` to their DeepSpeed config."""
    settings = dict(options["strategy"])
    if case.get("offload"):
        settings["config"] = merge_configs(settings.get("config") or {}, OFFLOAD_OPTIMIZER)
    return lightning_hpz.HpzStrategy(**settings)


def run_case(case: dict, options: dict) -> tuple[int, dict]:
    """Train one case; returns this process's global rank (Lightning's launcher sets no RANK) and its record."""
    L.seed_everything(0, verbose=False)
    model = CombinationModel(
        case.get("frozen", False), case.get("tied", False), case.get("checkpointing"), case.get("offload", False)
    )
    trainer = L.Trainer(
        strategy=case_strategy(case, options),
        accelerator="cpu",
        devices=options.get("devices", 4),
        num_nodes=options.get("num_nodes", 1),
        max_steps=options["steps"],
        precision=case.get("precision", "32-true"),
        accumulate_grad_batches=case.get("accumulate", 1),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(token_data(), batch_size=4, shuffle=True))
    engine = trainer.strategy.model
    record = {
        "losses": model.losses,
        "most_secondaries": model.most_secondaries,
        "optimizer": type(engine.basic_optimizer).__name__,  # what stepped: DeepSpeedCPUAdam when offloaded
        "offloaded": bool(engine.zero_offload_optimizer()),
    }
    return trainer.global_rank, record


def main(options: dict) -> None:
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    record, rank = {}, 0
    for name, case in options["cases"].items():
        rank, record[name] = run_case(case, options)
    (out / f"rank{rank}.json").write_text(json.dumps({"cases": record}))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
