"""Checkpoints you can trust and move: integrity manifest, atomic commit, resume on another world size, clear refusals.

Light to import (no torch): ``manifest`` and ``errors`` serve the command-line tools too. The pieces that need a run
(``commit``, ``resume``, ``universal``, ``compatibility``) are imported by the strategy where it uses them.
"""

from lightning_hpz.checkpointing.errors import (
    CheckpointIntegrityError,
    CheckpointMismatchError,
    CheckpointRefusedError,
    CheckpointStorageError,
)
from lightning_hpz.checkpointing.manifest import MANIFEST_NAME, last_good_checkpoint, read_manifest

__all__ = [
    "MANIFEST_NAME",
    "CheckpointIntegrityError",
    "CheckpointMismatchError",
    "CheckpointRefusedError",
    "CheckpointStorageError",
    "last_good_checkpoint",
    "read_manifest",
]
