"""Resume on a different number of ranks: convert the checkpoint once to DeepSpeed's universal format, cached in it.

ZeRO shards the fp32 weights and optimizer moments by data-parallel rank; DeepSpeed refuses to load them on another
world size. ``deepspeed.checkpoint.ds_to_universal`` merges the shards into one file per parameter and state
(``fp32``, ``exp_avg``, ``exp_avg_sq``), which any world size then re-shards on load. Weights, optimizer moments and
step counters move exactly; the order of the data does not when the global batch changes (see ``DATA_ORDER_WARNING``).

The converted copy lives in ``<ckpt>/universal`` (or, for a checkpoint that cannot be written, in the cache folder of
:mod:`~lightning_hpz.checkpointing.universal_location`): written by rank 0 into ``universal.partial`` and renamed when
complete, so an interrupted conversion is redone, a finished one reused. The other ranks wait for it in the job's
key-value store, not in a collective: a 70B checkpoint converts for longer than the process group's timeout.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

from lightning_hpz import collectives
from lightning_hpz.checkpointing.errors import CheckpointMismatchError
from lightning_hpz.checkpointing.manifest import DEEPSPEED_TAG, UNIVERSAL_DIR
from lightning_hpz.checkpointing.universal_location import universal_location

DATA_ORDER_WARNING = (
    "Resuming a checkpoint written on {saved} ranks on {current} ranks: weights, optimizer moments and step counters "
    "are restored exactly, but a global batch now holds {current} per-rank batches instead of {saved}, so the samples "
    "each step sees and the data order from here on differ from the original run."
)


CONVERSION_WAIT = timedelta(hours=24)  # how long the other ranks wait for rank 0's conversion
_ASKED = itertools.count()


def universal_copy(checkpoint_dir: Path) -> Path:
    """The universal-format copy of ``checkpoint_dir`` (converted now on rank 0 if absent), the same on all ranks."""
    failure = ""
    try:
        target = universal_location(Path(checkpoint_dir))
    except PermissionError as error:  # read-only and no cache folder: the same on every rank
        target, failure = Path(checkpoint_dir) / UNIVERSAL_DIR, str(error)
    if collectives.rank() == 0 and not failure and not target.is_dir():
        try:
            convert_to_universal(Path(checkpoint_dir), target)
        except Exception as error:  # reported identically on every rank below, instead of hanging the others
            failure = f"{type(error).__name__}: {error}"
    failure = _outcome_of_rank_zero(failure, target)
    if failure:
        raise CheckpointMismatchError(
            f"Could not convert {checkpoint_dir} to DeepSpeed's universal format to resume it on a different number "
            f"of ranks ({failure}). Resume on the number of ranks that wrote it."
        )
    return target


def _outcome_of_rank_zero(failure: str, target: Path) -> str:
    """Rank 0's outcome on every rank, waited for in the job's store (no process-group timeout applies there)."""
    store = collectives.default_store()
    if store is None or collectives.world_size() == 1:
        return failure
    # every rank asks once per resize, in the same order: the count names this one without a collective
    key = f"lightning_hpz/universal/{target}/{next(_ASKED)}"
    if collectives.rank() == 0:
        store.set(key, failure or "ok")
    else:
        store.wait([key], CONVERSION_WAIT)
    outcome = store.get(key).decode()
    return "" if outcome == "ok" else outcome


def convert_to_universal(checkpoint_dir: Path, target: Path, quiet: bool = True) -> None:
    from deepspeed.checkpoint import ds_to_universal

    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    args = argparse.Namespace(
        input_folder=str(checkpoint_dir / DEEPSPEED_TAG),
        output_folder=str(partial / DEEPSPEED_TAG),
        num_extract_workers=1,  # in this process: a training rank should not fork worker pools
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # Lightning's ZeRO-1/2 checkpoints lack the universal-info block
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as output:
        if quiet:  # its progress bars show otherwise (the convert command)
            output.enter_context(contextlib.redirect_stdout(io.StringIO()))
            output.enter_context(contextlib.redirect_stderr(io.StringIO()))
        ds_to_universal.main(args)
    (partial / "latest").write_text(DEEPSPEED_TAG)  # Lightning checks for it before handing the path to DeepSpeed
    partial.rename(target)


# optimizers whose state the universal conversion carries completely (exp_avg and exp_avg_sq, and the step)
CONVERTIBLE_OPTIMIZERS = frozenset({"Adam", "AdamW", "FusedAdam", "DeepSpeedCPUAdam"})


def restore_group_settings(optimizer: Any, groups: Any) -> None:
    """Put each parameter group's recorded settings back (the group count must match: same model, same optimizer)."""
    if not groups or optimizer is None or len(optimizer.param_groups) != len(groups):
        return
    for group, settings in zip(optimizer.param_groups, groups, strict=True):
        for key, value in settings.items():
            if key in group:
                group[key] = tuple(value) if isinstance(group[key], tuple) else value
