"""Atomic commit: a checkpoint appears at its path only once every rank's files are complete and checksummed.

DeepSpeed writes ``latest`` from rank 0 whatever the other ranks did, so a rank that dies half-way through its shard
leaves a directory that looks complete. Here the checkpoint is written into ``.hpz-staging/<name>.partial`` beside
``<path>``; after a barrier each rank checksums the files it wrote (in parallel), rank 0 writes the manifest last and
renames the directory into place. A crash at any point before that rename leaves ``<path>`` untouched: the previous
checkpoint stays the newest, and Lightning (``ModelCheckpoint``'s paths, ``ckpt_path="last"``) never sees the partial
one. The staging folder is hidden because Lightning finds ``ckpt_path="hpc"`` by the largest number in any name
containing ``hpc_ckpt_``: a ``hpc_ckpt_3.ckpt.partial`` beside the others, left by a job killed while saving, would
send the requeued job to a ``hpc_ckpt_3.ckpt`` that does not exist.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lightning_hpz import collectives
from lightning_hpz.checkpointing import manifest

STAGING_FOLDER = ".hpz-staging"
PARTIAL_SUFFIX = ".partial"
REPLACED_SUFFIX = ".replaced"


def staging_path(final: Path) -> Path:
    return final.parent / STAGING_FOLDER / (final.name + PARTIAL_SUFFIX)


def replaced_path(final: Path) -> Path:
    return final.parent / STAGING_FOLDER / (final.name + REPLACED_SUFFIX)


@contextmanager
def committed_save(final: Path, run: dict[str, Any]) -> Iterator[Path]:
    """Yield the staging directory to save into; on exit, checksum, write the manifest and move it to ``final``."""
    final = Path(final)
    staging = staging_path(final)
    if collectives.rank() == 0:
        if staging.exists():
            shutil.rmtree(staging)  # left by a run that crashed while saving
        staging.parent.mkdir(parents=True, exist_ok=True)
    collectives.barrier()
    yield staging
    collectives.barrier()  # every rank's files are complete
    mine = manifest.digests(staging, manifest.files_written_by(staging, collectives.rank(), collectives.world_size()))
    every_rank = collectives.all_gather_object(mine)
    if collectives.rank() == 0:
        files = {name: entry for part in every_rank for name, entry in part.items()}
        manifest.write_manifest(staging, files, run)
        _move_into_place(staging, final)
        with contextlib.suppress(OSError):  # still holding another save's files, or already gone
            staging.parent.rmdir()
    collectives.barrier()


def _move_into_place(staging: Path, final: Path) -> None:
    # Overwriting (``last.ckpt``): the old copy moves aside first and is deleted only after the new one is in place.
    replaced = replaced_path(final)
    if final.exists():
        if replaced.exists():
            shutil.rmtree(replaced)
        final.rename(replaced)
    staging.rename(final)
    if replaced.exists():
        shutil.rmtree(replaced)
