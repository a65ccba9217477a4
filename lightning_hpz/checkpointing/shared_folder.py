"""Refuse, at the first save, a checkpoint folder that is not one folder for every rank (node-local disks).

A commit moves every rank's files into place from rank 0, and a resume reads every file from every rank: both need a
folder all ranks see. On node-local disks (or DeepSpeed's ``use_node_local_storage``) the other nodes' shards stay in
their own staging folders and every resume fails as "missing", after hours of training. So before the first save into
a folder, rank 0 writes a token there and every rank reads it back; a rank that cannot is named, with its host, on
every rank, before anything is written.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
from pathlib import Path
from typing import Optional

from lightning_hpz import collectives
from lightning_hpz.checkpointing.errors import CheckpointStorageError
from lightning_hpz.checkpointing.rank_agreement import agreed

PROBE_NAME = ".hpz-shared-folder-probe"
_checked: set[str] = set()


def check_one_folder_for_all_ranks(folder: Path, probe_dir: Optional[Path] = None) -> None:
    """Raise :class:`CheckpointStorageError` on every rank when some rank does not see what rank 0 writes in ``folder``.

    Collective; once per folder and process. The token goes into ``probe_dir`` (a folder inside ``folder``; default
    ``folder`` itself), which must exist on rank 0; the error names ``folder``.
    """
    key = str(Path(folder).resolve())
    if key in _checked or not collectives.is_distributed():
        return
    # the token is in the file's name too: two jobs started into one folder at once each read their own probe, and
    # the second meets the writer lock's refusal naming the first, not a false "node-local disks"
    token = secrets.token_hex(8) if collectives.rank() == 0 else None
    probe = Path(probe_dir if probe_dir is not None else folder) / f"{PROBE_NAME}-{token}"
    if token is not None:
        probe.write_text(token)
    token = collectives.broadcast_object(token)
    probe = probe.with_name(f"{PROBE_NAME}-{token}")
    seen = probe.is_file() and probe.read_text() == token
    # one all-reduce of a number when every rank sees it; names travel only from ranks that do not
    blind = agreed([] if seen else [f"rank {collectives.rank()} on {socket.gethostname()}"])
    if collectives.rank() == 0:
        with contextlib.suppress(OSError):
            probe.unlink()
    if blind:
        ranks = ", ".join(blind)
        raise CheckpointStorageError(
            f"Checkpoint folder {folder} is not one folder for all ranks: {ranks} cannot see a file rank 0 wrote there "
            "(node-local disks?). Every rank writes its shards into it and reads all of them at resume, so the "
            "checkpoint would be unusable. Save to a file system every node mounts (ModelCheckpoint(dirpath=...) or "
            "Trainer(default_root_dir=...) on a shared path)."
        )
    _checked.add(key)
