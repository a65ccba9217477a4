"""Order the gathers of ZeRO-3 parameters that were converted before the strategy wrapped DeepSpeed.

A ``deepspeed.zero.Init`` entered before the strategy was set up (a script that builds its model first, or another
copy of DeepSpeed's ``Init``) gives its parameters DeepSpeed's plain ``all_gather_coalesced``. Once the ordering
holds DeepSpeed's own copy synchronize off, such a gather could read a secondary shard before its copy landed: in
``"event"`` mode the race of arXiv 2407.01614 would be back for exactly those parameters. At setup every such
parameter either gets the ordered gather or, when it has no gather this package can wrap, keeps DeepSpeed's own
synchronize after each of its copies.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn

from lightning_hpz.partitioning.deepspeed_patch import ORDERED_GATHER_MARK, STOCK_COPY_SYNC_MARK, ordered_gather
from lightning_hpz.partitioning.sharded_parameters import is_partitioned

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConvertedParameters:
    """What :func:`order_converted_parameters` did to the parameters it found unordered."""

    wrapped: int = 0
    stock_sync: int = 0


def gather_is_ordered(param: nn.Parameter) -> bool:
    return getattr(getattr(param, "all_gather_coalesced", None), ORDERED_GATHER_MARK, False)


def order_converted_parameters(module: nn.Module) -> ConvertedParameters:
    """Give every ZeRO-3 parameter of ``module`` an ordered gather, or DeepSpeed's own copy synchronize."""
    wrapped = stock_sync = 0
    for param in module.parameters():
        if not is_partitioned(param) or gather_is_ordered(param) or getattr(param, STOCK_COPY_SYNC_MARK, False):
            continue
        gather = getattr(param, "all_gather_coalesced", None)
        if callable(gather):
            param.all_gather_coalesced = ordered_gather(gather)
            wrapped += 1
        else:
            setattr(param, STOCK_COPY_SYNC_MARK, True)
            stock_sync += 1
    if wrapped or stock_sync:
        log.info(
            "hpZ: %d ZeRO-3 parameters were converted before the strategy was set up; %d now wait for their copies "
            "before gathering, %d keep DeepSpeed's own synchronize after each copy.",
            wrapped + stock_sync,
            wrapped,
            stock_sync,
        )
    return ConvertedParameters(wrapped=wrapped, stock_sync=stock_sync)
