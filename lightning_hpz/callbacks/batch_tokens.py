"""What one batch holds: real tokens (attention mask), samples, and the positions the model computes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch


@dataclass(frozen=True)
class BatchTokens:
    """``real_tokens``: positions the attention mask marks as real (input and, for an encoder-decoder, target);
    ``input_positions``/``target_positions``: sequence lengths as computed (padding included), per sample."""

    samples: int
    real_tokens: Union[int, torch.Tensor]  # a 0-d tensor on the batch's device when counted there (no host sync)
    input_positions: int
    target_positions: Optional[int] = None


def _field(batch: Any, name: str) -> Optional[torch.Tensor]:
    value = batch.get(name) if isinstance(batch, Mapping) else getattr(batch, name, None)
    return value if isinstance(value, torch.Tensor) else None


def _count_real(
    ids: torch.Tensor, mask: Optional[torch.Tensor], pad_id: Optional[int], on_device: bool
) -> Union[int, torch.Tensor]:
    if mask is not None:
        real = mask.sum()
    elif pad_id is not None:
        real = (ids != pad_id).sum()
    else:
        return ids.numel()
    # Reading a sum of a GPU tensor waits for the GPU: a callback that runs every step keeps it on the device.
    return real if on_device else int(real)


def _detect_batch_tokens(batch: Any, target_pad_id: int = -100, on_device: bool = False) -> BatchTokens:
    """Count a batch given as a mapping (or object) with ``input_ids`` and optional ``attention_mask``,
    ``decoder_input_ids``/``decoder_attention_mask``/``labels`` (targets padded with ``target_pad_id``), or as a
    tensor of token ids / a tuple whose first item is one (every position then counts as real). ``on_device``: leave
    the real-token count as a tensor on the batch's device."""
    ids = _field(batch, "input_ids")
    if ids is None:
        first = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
        if not isinstance(first, torch.Tensor):
            raise ValueError(
                f"Cannot count tokens in a batch of type {type(batch).__name__}: give the callback a `tokens_fn` "
                "(batch -> BatchTokens), or use batches with `input_ids` (and `attention_mask`)."
            )
        ids = first
    ids = ids if ids.dim() > 1 else ids.unsqueeze(0)  # (B, S)
    real = _count_real(ids, _field(batch, "attention_mask"), None, on_device)
    targets = _field(batch, "decoder_input_ids")
    target_mask = _field(batch, "decoder_attention_mask")
    labels = _field(batch, "labels")
    if targets is None and labels is not None and labels.shape != ids.shape:
        targets = labels  # an encoder-decoder's labels: the decoder runs on shifted labels of this length
    target_positions = None
    if targets is not None:
        target_positions = targets.shape[-1]
        real = real + _count_real(targets, target_mask, None if target_mask is not None else target_pad_id, on_device)
    return BatchTokens(ids.shape[0], real, ids.shape[-1], target_positions)
