"""Pack a token stream into fixed-length training sequences."""

from __future__ import annotations

import torch


class SequenceTooLongError(ValueError):
    """The corpus is shorter than what one sequence (or one per rank) needs."""


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
