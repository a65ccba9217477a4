"""Resume a checkpoint written at the end of an epoch as the start of the next one.

``ModelCheckpoint(save_on_train_epoch_end=True)`` saves in ``on_train_epoch_end``: every batch of the epoch is done
(``processed``) but the fit loop has not yet counted the epoch ``completed``. Lightning 2.6 completes such an epoch on
load only when training is bounded by epochs. With ``max_steps`` set (``_FitLoop._iteration_based_training``), the
restart stage is ``RESTARTED_ON_EPOCH_END`` and nothing completes it (``lightning/pytorch/loops/fit_loop.py``:
``_FitLoop.reset``, ``on_run_start``, ``on_advance_start``); the epoch loop then runs one extra batch in the finished
epoch, because ``_TrainingEpochLoop.done`` waits for a validation run that never comes
(``training_epoch_loop.py``: ``_is_validation_done``). That batch is drawn with the next epoch's sampler seed, so the
first loss after resume still matches; the epoch counter then advances twice, and every later batch comes from the
epoch after the one the uninterrupted run trains on.

The fix edits the loop state in the loaded checkpoint so that it reads as saved just after the epoch completed, the
state Lightning itself reaches on the epoch-bounded path.
"""

from __future__ import annotations

from typing import Any

_FIT_LOOP = ("loops", "fit_loop")
# The epoch-loop progress Lightning resets when an epoch starts (``_TrainingEpochLoop.reset``, not restarting).
_CURRENT_PROGRESS_RESET_AT_EPOCH_START = (
    "epoch_loop.batch_progress",
    "epoch_loop.scheduler_progress",
)


def saved_at_epoch_end(epoch_progress: dict[str, dict[str, int]]) -> bool:
    """Whether every started epoch was processed and exactly the last one was not yet counted completed."""
    for counts in (epoch_progress["total"], epoch_progress["current"]):
        if not counts["ready"] == counts["started"] == counts["processed"] == counts["completed"] + 1:
            return False
    return True


def complete_epoch_saved_at_epoch_end(checkpoint: dict[str, Any]) -> bool:
    """Mark the epoch a checkpoint was saved at the end of as completed; return whether anything changed.

    Checkpoints saved elsewhere (mid-epoch, after an epoch completed, or by a Lightning without progress tracking)
    are left as they are.
    """
    fit_loop = checkpoint.get(_FIT_LOOP[0], {}).get(_FIT_LOOP[1])
    if not fit_loop or "epoch_progress" not in fit_loop or not saved_at_epoch_end(fit_loop["epoch_progress"]):
        return False
    for counts in fit_loop["epoch_progress"].values():
        counts["completed"] = counts["processed"]
    for key in _CURRENT_PROGRESS_RESET_AT_EPOCH_START:
        if key in fit_loop:
            _zero(fit_loop[key]["current"])
    if "epoch_loop.batch_progress" in fit_loop:
        fit_loop["epoch_loop.batch_progress"]["is_last_batch"] = False
    optim_progress = fit_loop.get("epoch_loop.automatic_optimization.optim_progress", {})
    for progress in optim_progress.get("optimizer", {}).values():
        _zero(progress["current"])
    if "epoch_loop.val_loop.batch_progress" in fit_loop:
        _zero(fit_loop["epoch_loop.val_loop.batch_progress"]["total"])
    # the training loaders' positions too (ResumableLoader): the next epoch starts every loader at its beginning,
    # also a shorter one that Lightning had cycled part-way through its round
    for state in (fit_loop.get("state_dict") or {}).get("combined_loader") or []:
        if isinstance(state, dict) and "batches_consumed" in state:
            state["batches_consumed"] = 0
    return True


def _zero(counts: dict[str, int]) -> None:
    for name in counts:
        counts[name] = 0
