"""Reading and writing weights that ZeRO-3 may have partitioned, through DeepSpeed's public API only.

Shapes and sizes of partitioned parameters come from :mod:`lightning_hpz.partitioning.sharded_parameters`, the
package that owns DeepSpeed's ``ds_*`` attributes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Optional

import torch
from torch import nn

from lightning_hpz.partitioning.sharded_parameters import (  # noqa: F401 - re-exported for the model code
    full_element_count,
    full_shape,
    is_partitioned,
    local_element_count,
)


@contextmanager
def gathered(params: Iterable[torch.Tensor], modifier_rank: Optional[int] = None) -> Iterator[None]:
    """Make the full ``params`` visible inside the block; with ``modifier_rank`` its writes are kept on all ranks."""
    partitioned = [p for p in params if is_partitioned(p)]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=modifier_rank):
        yield


def init_targets(module: nn.Module) -> list[torch.Tensor]:
    """Parameters a transformers ``_init_weights(module)`` may write: its own and those of its leaf children.

    (T5 initialises ``shared`` and ``lm_head`` from the top-level model, its attention's q/k/v/o from the attention
    block.) Deeper subtrees are left out, so at most one block's leaf layers are gathered at a time, never the model.
    """
    own = list(module.parameters(recurse=False))
    leaves = [p for child in module.children() if not any(child.children()) for p in child.parameters()]
    return list({id(p): p for p in own + leaves}.values())


def initialize_partitioned_weights(model: nn.Module) -> None:
    """Apply a transformers model's own weight initialisation to its ZeRO-3 partitioned parameters.

    Built inside ``zero.Init``, each layer is partitioned as soon as it exists, so the model's ``post_init`` finds
    empty tensors and the weights keep PyTorch's layer defaults (an N(0, 1) embedding, tied to Falcon's output
    layer, starts training at a loss of about 50). Here every module is initialised with its parameters gathered,
    on rank 0, and the result is re-partitioned to all ranks. The draws come in another order than in a ZeRO-1/2
    build, so the same seed gives other weights: :func:`~lightning_hpz.models.initialize_by_name` does not (this is
    what ``layout_independent_init=False`` keeps).
    """
    if not any(is_partitioned(p) for p in model.parameters()):
        return
    # Children before parents, as transformers does: a parent (T5's gated feed-forward, its attention) overrides
    # the generic init its child layers got with its own scaled one.
    for module in reversed(list(model.modules())):
        targets = init_targets(module)
        if not targets:
            continue
        with gathered(targets, modifier_rank=0), torch.no_grad():
            model._init_weights(module)
