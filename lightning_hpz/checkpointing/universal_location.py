"""Where the universal-format copy of a checkpoint lives: inside the checkpoint, or in a cache folder when the
checkpoint cannot be written (a read-only or archived checkpoint, another team's run).

``LIGHTNING_HPZ_UNIVERSAL_CACHE`` names a folder every rank sees; each checkpoint's copy gets its own subfolder there,
named after the checkpoint and a digest of its manifest (or path), so two checkpoints of one name never share a copy.
``lightning-hpz checkpoint convert CKPT --cache DIR`` writes the same place ahead of a run.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path
from typing import Optional

from lightning_hpz.checkpointing.manifest import MANIFEST_NAME, UNIVERSAL_DIR

CACHE_ENV_VAR = "LIGHTNING_HPZ_UNIVERSAL_CACHE"


def universal_location(checkpoint_dir: Path, cache: Optional[Path] = None) -> Path:
    """The copy's folder: ``cache`` (or ``$LIGHTNING_HPZ_UNIVERSAL_CACHE``) when given or when the checkpoint cannot
    be written, else ``<checkpoint>/universal``. A copy already inside the checkpoint is always used."""
    checkpoint_dir = Path(checkpoint_dir)
    inside = checkpoint_dir / UNIVERSAL_DIR
    cache = cache or (Path(os.environ[CACHE_ENV_VAR]) if os.environ.get(CACHE_ENV_VAR) else None)
    if inside.is_dir() or (cache is None and is_writable(checkpoint_dir)):
        return inside
    if cache is None:
        raise PermissionError(
            f"{checkpoint_dir} cannot be written, so its copy in DeepSpeed's universal format (needed to resume it "
            f"on another number of ranks) cannot go inside it. Set {CACHE_ENV_VAR} to a folder every rank sees, "
            f"or convert it first: `lightning-hpz checkpoint convert {checkpoint_dir} --cache DIR`."
        )
    return Path(cache) / f"{checkpoint_dir.name}-{_identity(checkpoint_dir)}"


def is_writable(folder: Path) -> bool:
    """Whether a file can be created in ``folder``; tried, since root passes ``os.access`` on read-only mounts."""
    probe = folder / f".hpz-write-probe-{uuid.uuid4().hex}"
    try:
        probe.touch()
    except OSError:
        return False
    probe.unlink(missing_ok=True)
    return True


def _identity(checkpoint_dir: Path) -> str:
    manifest = checkpoint_dir / MANIFEST_NAME
    source = manifest.read_bytes() if manifest.is_file() else str(checkpoint_dir.resolve()).encode()
    return hashlib.blake2b(source, digest_size=6).hexdigest()
