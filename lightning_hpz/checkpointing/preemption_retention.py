"""Preemption checkpoints must not shadow newer ones at auto-resume, nor pile up.

Lightning's SLURM auto-resume (and ``ckpt_path="hpc"``) takes ``hpc_ckpt_<N>`` with the largest N whenever one exists
in ``default_root_dir``, even when a ``last.ckpt`` written after it is newer: a requeued job would silently go back to
the older step. So after every commit, the preemption checkpoints older (by global step) than the one just committed
are retired: renamed ``preempted-step=<S>.ckpt``, which auto-resume does not look at, and of those only the newest
``keep`` are kept (a 70B checkpoint is about a terabyte).
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
