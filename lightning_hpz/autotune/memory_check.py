"""After the first optimizer step, compare the memory a rank really used with the budget the tuner chose for.

The planner predicts parameters, gradients, optimizer states and gathered parameters; activations and temporaries are
covered only by the headroom it leaves (``MEMORY_HEADROOM``). A long sequence or a large micro-batch can need more:
this check says so after step 1, with the numbers, instead of an out-of-memory error hours later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from lightning_hpz import collectives
from lightning_hpz.planning.tuning import GIB, MEMORY_HEADROOM
from lightning_hpz.planning.tuning_decision import TuningDecision
from lightning_hpz.process_memory import max_rss_bytes


@dataclass(frozen=True)
class MemoryCheck:
    """The busiest rank's peak memory through the first optimizer step, against the budget per rank."""

    peak_gib: float
    budget_gib: float
    predicted_gib: float  # the chosen candidate's parameters, gradients, optimizer states and gathers

    @property
    def within_budget(self) -> bool:
        return self.peak_gib <= self.budget_gib

    def message(self) -> str:
        measured = (
            f"hpZ autotune: through the first optimizer step the busiest rank peaked at {self.peak_gib:.2f} GiB, "
            f"against a budget of {self.budget_gib:.2f} GiB per rank (the choice predicted {self.predicted_gib:.2f} "
            f"GiB for parameters, gradients, optimizer states and gathers, and left {MEMORY_HEADROOM:.0%} for the rest)"
        )
        if self.within_budget:
            return measured + "."
        return (
            measured + ". Activations and temporaries need more than that headroom, so the run may run out of memory "
            "on a longer batch. Give a smaller autotune_memory_gib to make the tuner choose a leaner configuration, "
            "lower the micro-batch size, or turn on activation checkpointing."
        )


def peak_memory_bytes(device: torch.device) -> float:
    """This process's peak memory so far: what the CUDA allocator reserved, or on CPU the peak resident set."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_reserved(device))
    return float(max_rss_bytes())


def check_memory(decision: TuningDecision, device: torch.device, own_peak_bytes: Optional[float] = None) -> MemoryCheck:
    """The check on every rank's figures (a collective: every rank calls it, with the same decision)."""
    own = peak_memory_bytes(device) if own_peak_bytes is None else own_peak_bytes
    peak = collectives.all_reduce_values([own], op="max")[0]
    chosen = next((c for c in decision.candidates if c.get("name") == decision.candidate), {})
    return MemoryCheck(peak / GIB, decision.memory_budget_gib, float(chosen.get("predicted_memory_gib", 0.0)))
