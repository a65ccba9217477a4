"""Fixed-length training sequences cut from a token stream, in order, the last partial one dropped."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

from lightning_hpz.data.prepared_shards import PreparedShards


class SequenceTooLongError(ValueError):
    """The corpus is shorter than what one sequence (or one global batch) needs."""


def pack_tokens(tokens: torch.Tensor, length: int) -> torch.Tensor:
    """Cut the 1-D stream into ``(N, length)`` consecutive blocks; the last partial block is dropped."""
    if length < 2:
        raise ValueError(f"sequence length {length} is too short; use at least 2 tokens.")
    count = tokens.numel() // length
    if count == 0:
        raise SequenceTooLongError(
            f"The corpus has {tokens.numel()} tokens, fewer than one sequence of {length}. Use a larger corpus or a "
            "shorter sequence_length."
        )
    return tokens[: count * length].view(count, length).long()


class PackedBlocks(Dataset):
    """Blocks ``first`` to ``first + count`` of ``length`` consecutive tokens of the prepared stream, read on access.

    Item ``i`` is ``{"sample_index": i, "block": LongTensor(length)}``; block ``b`` is tokens ``b*length`` to
    ``(b+1)*length``, exactly what :func:`pack_tokens` gives for the whole stream.
    """

    def __init__(self, shards: PreparedShards, length: int, first: int, count: int) -> None:
        if length < 2:
            raise ValueError(f"sequence length {length} is too short; use at least 2 tokens.")
        self.shards, self.length, self.first, self.count = shards, length, first, count

    def __len__(self) -> int:
        return self.count

    def block(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.count:
            raise IndexError(f"block {index} outside [0, {self.count})")
        start = (self.first + index) * self.length
        return torch.from_numpy(self.shards.read(start, start + self.length).astype("int64"))

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"sample_index": index, "block": self.block(index)}
