"""Preemption checkpoints must not pile up (a 70B checkpoint is about a terabyte).

Lightning's SLURM auto-resume starts when an ``hpc_ckpt_<N>`` is there (and, by itself, takes the largest N; the
package then takes the newest committed checkpoint of the run, ``resume_choice.py``). After a preemption checkpoint is
committed, the older ones (by global step) are retired: renamed ``preempted-step=<S>.ckpt``, outside Lightning's
numbering, and of those only the newest ``keep`` are kept. Only a preemption checkpoint retires others: the newest of
them must stay for auto-resume to start.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Optional

from lightning_hpz.checkpointing import manifest

_PREEMPTION = re.compile(r"^hpc_ckpt_(\d+)\.ckpt$")
_RETIRED = re.compile(r"^preempted-step=(\d+)\.ckpt$")
DEFAULT_KEEP = 1


def is_preemption_checkpoint(path: Path) -> bool:
    return bool(_PREEMPTION.match(Path(path).name))


def _step(path: Path) -> Optional[int]:
    recorded = manifest.read_manifest(path) if path.is_dir() else None
    step = (recorded or {}).get("run", {}).get("global_step")
    return int(step) if step is not None else None


def retire_older_preemption_checkpoints(root: Path, committed_step: int, keep: int = DEFAULT_KEEP) -> list[str]:
    """Retire the ``hpc_ckpt_*`` in ``root`` older than ``committed_step``; prune the retired ones to ``keep``.

    Returns what was done, one line each. Checkpoints without a manifest (not written by this package) are left alone.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    done = []
    for path in sorted(root.iterdir()):
        step = _step(path) if _PREEMPTION.match(path.name) else None
        if step is None or step >= committed_step:
            continue
        retired = root / f"preempted-step={step}.ckpt"
        if retired.exists():
            shutil.rmtree(retired)
        path.rename(retired)
        done.append(f"{path.name} (step {step}) -> {retired.name}")
    retired_by_step = sorted(
        ((int(match.group(1)), path) for path in root.iterdir() if (match := _RETIRED.match(path.name))), reverse=True
    )
    for _, path in retired_by_step[max(keep, 0) :]:
        shutil.rmtree(path)
        done.append(f"deleted {path.name}")
    return done
