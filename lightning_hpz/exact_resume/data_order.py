"""Check at resume that the training data will come in the order the interrupted run would have used.

A checkpoint holds weights, optimizer state and loop counters, not the sampler: the order of the next batches is
rebuilt from the sampler's seed and the epoch number. Lightning's distributed sampler is seeded by
``seed_everything`` (``PL_GLOBAL_SEED``, read in ``lightning/pytorch/trainer/connectors/data_connector.py``:
``_get_distributed_sampler``), so it reproduces its order only under the same seed; a ``RandomSampler`` draws a fresh
order from a generator whose state no checkpoint keeps. Either would make a resumed run silently train on other batches.

What the data alone decides (a ``RandomSampler``, a stream that cannot be positioned) is refused when training starts
(:func:`refuse_set_up_that_cannot_resume`), not hours later at the resume after a preemption; what depends on the
checkpoint (the sampler's seed) is checked at the resume (:func:`check_resumed_order`).
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from lightning_hpz import lightning_internals
from lightning_hpz.exact_resume.stream_position import position_source, reads_a_stream, unpositioned_reason


class DataOrderError(RuntimeError):
    """Resuming would train on other batches than the interrupted run, and ``exact_resume=True`` promised the same."""


def order_sampler(loader: Any) -> Any:
    """The sampler that decides the order of a dataloader's samples (under a batch sampler, if any)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    for sampler in (getattr(batch_sampler, "sampler", None), getattr(loader, "sampler", None)):
        if sampler is not None:  # not `or`: an empty sampler is falsy
            return sampler
    return batch_sampler


def order_record(loader: Any) -> dict[str, Any]:
    """What decides the order, as a checkpoint can store it: the sampler's kind, and its seed when it shuffles."""
    sampler = order_sampler(loader)
    shuffles = isinstance(sampler, DistributedSampler) and sampler.shuffle
    return {
        "sampler": type(sampler).__name__,
        "seed": int(sampler.seed) if shuffles and not isinstance(sampler, DistributedSamplerWrapper) else None,
    }


def order_problems(saved: Optional[dict[str, Any]], loader: Any) -> tuple[list[str], list[str]]:
    """(reasons the order will differ, reasons it cannot be verified) for resuming ``loader`` after ``saved``."""
    if isinstance(getattr(loader, "dataset", None), IterableDataset):
        return [], []  # a stream decides its own order; whether it can be positioned is checked by ResumableLoader
    sampler = order_sampler(loader)
    if isinstance(sampler, DistributedSamplerWrapper):
        sampler = lightning_internals.sampler_inside(sampler)  # the user's own sampler, which Lightning shards
    if isinstance(sampler, RandomSampler):
        return [
            "the training DataLoader shuffles with a RandomSampler, which draws a new order from a generator whose "
            "state no checkpoint keeps. Keep Lightning's distributed sampler (Trainer(use_distributed_sampler=True), "
            "the default, seeded by seed_everything) or give the DataLoader a sampler with `set_epoch`"
        ], []
    now = order_record(loader)
    if saved and saved.get("seed") is not None and now["seed"] is not None and saved["seed"] != now["seed"]:
        return [
            f"the training sampler is seeded with {now['seed']}, the checkpointed run used {saved['seed']}. Call "
            f"`lightning.seed_everything({saved['seed']})` before building the Trainer, as the interrupted run did"
        ], []
    if isinstance(sampler, (DistributedSampler, SequentialSampler)) or hasattr(sampler, "set_epoch"):
        return [], []
    return [], [f"the order of a {type(sampler).__name__} (no `set_epoch`) cannot be checked to repeat"]


def check_resumed_order(saved: Optional[dict[str, Any]], loader: Any, exact: bool) -> None:
    """Refuse (``exact``) or warn when a resumed run would see other batches than the interrupted one."""
    differ, unverifiable = order_problems(saved, loader)
    if differ and exact:
        raise DataOrderError(
            f"Cannot resume exactly: {differ[0]}. Or pass HpzStrategy(exact_resume=False) to resume with another order."
        )
    for reason in differ:
        rank_zero_warn(f"The resumed run will train on other batches than the interrupted one: {reason}.")
    for reason in unverifiable:
        rank_zero_warn(f"Resume may not continue exactly: {reason}.")


def problems_known_at_start(loader: Any) -> list[str]:
    """Why no mid-epoch resume of a run reading ``loader`` could continue with the same batches, whatever checkpoint
    it resumes from: its sampler draws an unrepeatable order, or it reads a stream that cannot be positioned."""
    differ, _ = order_problems(None, loader)  # no saved record: the sampler's kind alone
    if reads_a_stream(loader) and position_source(loader) is None:
        differ.append(unpositioned_reason(loader))
    return differ


def refuse_set_up_that_cannot_resume(problems: list[str]) -> None:
    """Refuse before the first step a run under ``exact_resume`` whose every mid-epoch resume (a preemption's among
    them) would be refused with ``DataOrderError``. ``problems``: :func:`problems_known_at_start`, all ranks' own."""
    if problems:
        raise DataOrderError(
            "exact_resume=True cannot hold for this training data: a resume from a mid-epoch checkpoint (a "
            f"preemption's, for one) would be refused, so the run is refused before it trains: {'; '.join(problems)}. "
            "Or pass HpzStrategy(exact_resume=False) to train anyway: its resumes then warn and continue without that "
            "guarantee."
        )


def set_epoch_before_iteration(loader: Any, epoch: int) -> None:
    """Give the loader's samplers the epoch about to be trained, as Lightning does, but before any iterator exists."""
    lightning_internals.set_sampler_epoch(loader, epoch)  # the sampler's and the batch sampler's


def saved_order(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The training loader's order record in a checkpoint; empty when it holds none."""
    states = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {}).get("combined_loader") or [{}]
    first = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
    return dict(first.get("order") or {})
