"""Why a checkpoint is refused. Raised with the same text on every rank, after the ranks agreed on it."""

from __future__ import annotations


class CheckpointRefusedError(RuntimeError):
    """A checkpoint that cannot be resumed here; every rank raises this same error, so no rank is left waiting."""


class CheckpointIntegrityError(CheckpointRefusedError):
    """A checkpoint file differs from what its manifest recorded when it was written (damaged, truncated, missing)."""


class CheckpointMismatchError(CheckpointRefusedError):
    """The checkpoint was written by a run this one cannot continue (ZeRO stage, model shape, optimizer, ...)."""


class CheckpointStorageError(RuntimeError):
    """Checkpoints cannot be saved where asked (a folder that is not the same for every rank); raised before writing."""
