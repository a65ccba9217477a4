"""Count, on a real GPU, the hpZ all-gathers that start before the secondary copy they read has landed.

The probe rides on the package's ordering hooks (``CopyOrdering.after_secondary_copy`` and
``before_secondary_gather``) without changing what they order:

* after a secondary copy is issued on the compute stream, a one-element flag is set to a new generation number on
  that same stream, so the flag holds the number only once the copy has finished;
* on the gathering stream, after the ordering has done its waiting and right before the all-gather, the flag is
  compared with the number it should hold, and a device counter goes up when it does not: that gather read a shard
  whose copy had not landed (a stale read, the race of arXiv 2407.01614).

Nothing here waits for the device; :meth:`StaleReadProbe.count` reads the counter once, at the end. ``delay_copies``
makes each secondary copy land late (``torch.cuda._sleep`` on the compute stream before it), as on a busy GPU, so
that an unordered run shows the race within a few steps.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

_FLAG_ATTR = "_stale_read_probe_flag"


class StaleReadProbe:
    def __init__(self, ordering: Any, device: torch.device) -> None:
        self._generation = itertools.count(1)
        self._stale = torch.zeros((), dtype=torch.int64, device=device)
        self.gathers_checked = 0
        self._wrap(ordering)

    def count(self) -> int:
        """Gathers that read a secondary shard before its copy landed (one host read, after every stream's work)."""
        torch.cuda.synchronize()  # the counter is written on the gathering stream
        return int(self._stale.item())

    def _wrap(self, ordering: Any) -> None:
        after_copy, before_gather = ordering.after_secondary_copy, ordering.before_secondary_gather

        def after_secondary_copy(secondary: torch.Tensor) -> None:
            generation = next(self._generation)
            flag = torch.full((), generation, dtype=torch.int64, device=secondary.device)  # queued after the copy
            setattr(secondary, _FLAG_ATTR, (flag, generation))
            after_copy(secondary)

        def before_secondary_gather(secondaries: Any) -> None:
            secondaries = list(secondaries)
            before_gather(secondaries)  # the ordering's own waits come first, as in a real run
            gathering = torch.cuda.current_stream()
            for secondary in secondaries:
                marker = getattr(secondary, _FLAG_ATTR, None)
                if marker is None:
                    continue
                flag, generation = marker
                flag.record_stream(gathering)  # read on this stream: keep its memory until the read is done
                self._stale.add_((flag != generation).to(torch.int64))
                self.gathers_checked += 1

        ordering.after_secondary_copy = after_secondary_copy
        ordering.before_secondary_gather = before_secondary_gather


def delay_copies(cycles: int) -> None:
    """Make every secondary copy of this process start ``cycles`` GPU clock cycles late on the compute stream."""
    from lightning_hpz.partitioning import deepspeed_patch

    original = deepspeed_patch._ORIGINAL_PARTITION_PARAM_SEC

    def late_partition(self: Any, param: Any, buffer: Any = None, has_been_updated: bool = False) -> None:
        torch.cuda._sleep(cycles)
        return original(self, param, buffer, has_been_updated)

    deepspeed_patch._ORIGINAL_PARTITION_PARAM_SEC = late_partition
