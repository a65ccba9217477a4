"""Where a checkpoint is staged while it is written and committed: ``.hpz-staging`` beside it.

The staging folder is hidden because Lightning finds ``ckpt_path="hpc"`` by the largest number in any name containing
``hpc_ckpt_``: a ``hpc_ckpt_3.ckpt.partial`` beside the others, left by a job killed while saving, would send the
requeued job to a ``hpc_ckpt_3.ckpt`` that does not exist.
"""

from __future__ import annotations

import shutil
from pathlib import Path

STAGING_FOLDER = ".hpz-staging"
PARTIAL_SUFFIX = ".partial"  # the copy being written (or, after an exchange, the old copy about to be deleted)
REPLACED_SUFFIX = ".replaced"  # the old copy, moved aside by a commit that cannot exchange


def staging_path(final: Path) -> Path:
    return final.parent / STAGING_FOLDER / (final.name + PARTIAL_SUFFIX)


def replaced_path(final: Path) -> Path:
    return final.parent / STAGING_FOLDER / (final.name + REPLACED_SUFFIX)


def remove_path(path: Path) -> None:
    """Remove whatever is at ``path``: a folder (a checkpoint), a file or a link (another strategy's checkpoint)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)
