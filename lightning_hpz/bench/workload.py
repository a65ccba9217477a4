"""The model and data every benchmark configuration trains: a small causal language model on synthetic tokens.

Sized so that at a few hundred Mbit/s between the nodes the parameter and gradient traffic, not the arithmetic,
dominates a step, while a step still takes about a second on a CPU. Every rank builds the same initial weights from
the seed and reads its own interleaved share of one fixed token set, whichever framework drives the training.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset


@dataclass(frozen=True)
class Workload:
    """Model shape, batch and optimizer of a benchmark run (the same for every configuration)."""

    vocab: int = 512
    width: int = 256
    layers: int = 2
    heads: int = 4
    sequence: int = 32
    batch_per_rank: int = 2
    learning_rate: float = 3e-3
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def tokens_per_rank_step(self) -> int:
        return self.batch_per_rank * self.sequence


FULL_WORKLOAD = Workload()
QUICK_WORKLOAD = Workload(vocab=256, width=128, layers=2, heads=4, sequence=16, batch_per_rank=2)


class CausalBlock(nn.Module):
    """Pre-norm attention + MLP block; the fused ``qkv`` keeps the number of gathered tensors low."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=-1)
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in (q, k, v))  # (B, nh, T, hs)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(attended)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class OutputHead(nn.Module):
    """Final norm and vocabulary projection, kept as one module so sharding frameworks can wrap it as a unit."""

    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.logits = nn.Linear(width, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(self.norm(x))


class TinyCausalLM(nn.Module):
    """Embedding, ``layers`` blocks, head; ``forward(tokens)`` returns the next-token cross-entropy."""

    def __init__(self, workload: Workload) -> None:
        super().__init__()
        self.embed = nn.Embedding(workload.vocab, workload.width)
        self.position = nn.Embedding(workload.sequence, workload.width)
        self.blocks = nn.ModuleList(CausalBlock(workload.width, workload.heads) for _ in range(workload.layers))
        self.head = OutputHead(workload.width, workload.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (B, T-1)
        positions = torch.arange(inputs.shape[1], device=inputs.device)
        x = self.embed(inputs) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)  # (B, T-1, vocab)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_model(workload: Workload) -> TinyCausalLM:
    """The same initial weights on every rank and in every configuration."""
    torch.manual_seed(workload.seed)
    return TinyCausalLM(workload)


def parameter_count(workload: Workload) -> int:
    with torch.device("meta"):
        model = TinyCausalLM(workload)
    return sum(p.numel() for p in model.parameters())


class MarkovTokens(Dataset):
    """Token sequences from a fixed random bigram chain: learnable structure, the same on every rank."""

    def __init__(self, workload: Workload, samples: int) -> None:
        generator = torch.Generator().manual_seed(workload.seed + 1)
        # Each token has 4 likely successors, so the loss has a clear floor (about log 4) to fall towards.
        successors = torch.randint(workload.vocab, (workload.vocab, 4), generator=generator)
        tokens = torch.empty(samples, workload.sequence + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(workload.vocab, (samples,), generator=generator)
        for position in range(1, workload.sequence + 1):
            choice = torch.randint(4, (samples,), generator=generator)
            tokens[:, position] = successors[tokens[:, position - 1], choice]
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.tokens[index]


def token_set(workload: Workload, steps: int, world_size: int) -> MarkovTokens:
    """Exactly enough sequences for ``steps`` steps of every rank."""
    return MarkovTokens(workload, samples=steps * world_size * workload.batch_per_rank)


def rank_loader(dataset: Dataset, workload: Workload, rank: int, world_size: int) -> DataLoader:
    """Rank ``rank``'s batches: sample ``rank``, ``rank + world_size``, ... as Lightning's distributed sampler gives."""
    indices = list(range(rank, len(dataset), world_size))
    return DataLoader(torch.utils.data.Subset(dataset, indices), batch_size=workload.batch_per_rank, shuffle=False)
