"""Resume on a different number of ranks: convert the checkpoint once to DeepSpeed's universal format, cached in it.

ZeRO shards the fp32 weights and optimizer moments by data-parallel rank; DeepSpeed refuses to load them on another
world size. ``deepspeed.checkpoint.ds_to_universal`` merges the shards into one file per parameter and state
(``fp32``, ``exp_avg``, ``exp_avg_sq``), which any world size then re-shards on load. Weights, optimizer moments and
step counters move exactly; the order of the data does not when the global batch changes (see ``DATA_ORDER_WARNING``).

The converted copy lives in ``<ckpt>/universal`` (``latest_universal`` -> ``checkpoint``): written by rank 0 into
``universal.partial`` and renamed when complete, so an interrupted conversion is redone, a finished one reused.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
from pathlib import Path
from typing import Any

from lightning_hpz import collectives
from lightning_hpz.checkpointing.errors import CheckpointMismatchError
from lightning_hpz.checkpointing.manifest import DEEPSPEED_TAG, UNIVERSAL_DIR

DATA_ORDER_WARNING = (
    "Resuming a checkpoint written on {saved} ranks on {current} ranks: weights, optimizer moments and step counters "
    "are restored exactly, but a global batch now holds {current} per-rank batches instead of {saved}, so the samples "
    "each step sees and the data order from here on differ from the original run."
)


def universal_copy(checkpoint_dir: Path) -> Path:
    """The universal-format copy of ``checkpoint_dir`` (converted now on rank 0 if absent), the same on all ranks."""
    target = Path(checkpoint_dir) / UNIVERSAL_DIR
    failure = ""
    if collectives.rank() == 0 and not target.is_dir():
        try:
            convert_to_universal(Path(checkpoint_dir), target)
        except Exception as error:  # reported identically on every rank below, instead of hanging the others
            failure = f"{type(error).__name__}: {error}"
    failure = collectives.broadcast_object(failure, src=0)
    if failure:
        raise CheckpointMismatchError(
            f"Could not convert {checkpoint_dir} to DeepSpeed's universal format to resume it on a different number "
            f"of ranks ({failure}). Resume on the number of ranks that wrote it."
        )
    return target


def convert_to_universal(checkpoint_dir: Path, target: Path) -> None:
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
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # progress prints
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
