"""A CPU run that takes the branches Lightning takes on CUDA, so that a CPU test proves what a GPU run does.

Lightning 2.6 evaluates (``validate``, ``test``, ``predict``) under ``torch.inference_mode`` on CUDA and under
``torch.no_grad`` when the process group is gloo (``lightning/pytorch/loops/utilities.py``, ``_no_grad_context``):
a CPU suite never sees inference tensors, which is how an hpZ crash on every GPU evaluation went unnoticed. With
``LIGHTNING_HPZ_EMULATE_CUDA_SEMANTICS=1`` a strategy on CPU makes Lightning take its CUDA branch there, from its
set-up to its teardown. The asynchronous copies of a GPU are emulated separately
(:mod:`lightning_hpz.partitioning.emulation`). Every branch of Lightning and DeepSpeed on backend or device, and what
covers each, is listed in docs/cuda-semantics.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Optional

CUDA_SEMANTICS_ENV_VAR = "LIGHTNING_HPZ_EMULATE_CUDA_SEMANTICS"
# Lightning internal: the module whose `_no_grad_context` picks the evaluation context, and the name it looks up on
# every call to decide whether the process group is gloo.
_LOOP_UTILITIES = "lightning.pytorch.loops.utilities"
_GLOO_PROBE = "_distributed_is_initialized"


def cuda_semantics_requested() -> bool:
    """Whether the environment asks for the emulation (the variable reaches every launched process)."""
    return os.environ.get(CUDA_SEMANTICS_ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


class CudaEvaluationContext:
    """Lightning's evaluation loops choose ``torch.inference_mode`` as on CUDA while installed (one owner at a time)."""

    _installed_by: Optional[CudaEvaluationContext] = None
    _original: Optional[Callable[[], bool]] = None

    def install(self) -> None:
        import importlib

        utilities = importlib.import_module(_LOOP_UTILITIES)
        if CudaEvaluationContext._installed_by is None:
            CudaEvaluationContext._original = getattr(utilities, _GLOO_PROBE)
            setattr(utilities, _GLOO_PROBE, _as_if_not_gloo)
        CudaEvaluationContext._installed_by = self

    def uninstall(self) -> None:
        import importlib

        if CudaEvaluationContext._installed_by is not self:
            return
        setattr(importlib.import_module(_LOOP_UTILITIES), _GLOO_PROBE, CudaEvaluationContext._original)
        CudaEvaluationContext._installed_by = CudaEvaluationContext._original = None


def _as_if_not_gloo(*args: Any, **kwargs: Any) -> bool:
    # `_no_grad_context` asks "distributed and gloo?" to fall back on no_grad; on CUDA the answer is no.
    return False
