"""The checkpoint a ``trainer.fit`` is about to resume, known before the strategy sets anything up."""

from __future__ import annotations

import sys
from typing import Any, Optional


def fit_resume_path(trainer: Any) -> Optional[Any]:
    """``trainer.ckpt_path`` when set; else the resolved ``ckpt_path`` that ``Trainer._run`` is running with.

    ``trainer.fit(model, ckpt_path=...)`` resolves the path (``"last"``, ``"hpc"``) and hands it to ``Trainer._run``,
    which stores it on the Trainer only after the strategy has built the engine (Lightning 2.6). The autotuner must
    know it before, so it reads the argument of that call; a Lightning without such a frame gives None (tune anew).
    """
    if trainer is None:
        return None
    if trainer.ckpt_path:
        return trainer.ckpt_path
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_run" and frame.f_locals.get("self") is trainer:
            return frame.f_locals.get("ckpt_path")
        frame = frame.f_back
    return None
