"""``lightning-hpz checkpoint convert CKPT_DIR [--cache DIR]``: the universal-format copy, made ahead of a resize.

A resume on another number of ranks converts the checkpoint with all its ranks before training; for a large model
that is still minutes of idle GPUs, and a checkpoint that cannot be written needs a cache folder. This runs the same
conversion in one process (a line per phase shown), verifies the checkpoint first, and says what the run needs to find
the copy. An interrupted conversion leaves ``*.partial`` behind, and running the command again resumes it: the ZeRO
shards and parameters done before are skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from lightning_hpz.checkpointing import manifest
from lightning_hpz.checkpointing.universal_location import CACHE_ENV_VAR, universal_location


def convert_checkpoint(checkpoint_dir: Path, cache: Optional[Path] = None) -> str:
    """Convert ``checkpoint_dir`` (into ``cache`` if given) and return what was done, for the terminal."""
    from lightning_hpz.checkpointing.consolidate import validate_checkpoint_dir
    from lightning_hpz.checkpointing.universal import convert_to_universal

    checkpoint_dir = validate_checkpoint_dir(checkpoint_dir)
    recorded = manifest.read_manifest(checkpoint_dir)
    if recorded is not None:
        problems = manifest.verify_files(checkpoint_dir, recorded, list(recorded["files"]))
        if problems:
            raise SystemExit(f"{checkpoint_dir} is damaged, not converted: {'; '.join(problems)}")
    target = universal_location(checkpoint_dir, cache)
    if target.is_dir():
        return f"{checkpoint_dir}: already converted, in {target}"
    progress = convert_to_universal(checkpoint_dir, target, quiet=False)
    where = f"in {target}"
    if progress is not None and progress.resumed():
        where += f" (resumed: {progress.summary()})"
    if cache is not None:
        where += f"; resume with {CACHE_ENV_VAR}={cache} set on every rank"
    return f"{checkpoint_dir}: converted {where}"
