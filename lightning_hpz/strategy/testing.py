"""The switches that exist for the test suite only, in one module: none of them changes what a user's run computes.

``LIGHTNING_HPZ_EMULATE_CUDA_SEMANTICS=1``: a strategy on CPU makes Lightning's evaluation loops take the branch they
take on CUDA, from its set-up to its teardown. Lightning evaluates (``validate``, ``test``, ``predict``) under
``torch.inference_mode`` on CUDA and under ``torch.no_grad`` when the process group is gloo
(``lightning/pytorch/loops/utilities.py``, ``_no_grad_context``): a CPU suite never sees inference tensors, which is
how an hpZ crash on every GPU evaluation went unnoticed. The variable reaches every launched process. The
asynchronous copies of a GPU are emulated separately (:mod:`lightning_hpz.partitioning.emulation`, also a user
option). Every branch of Lightning and DeepSpeed on backend or device, and what covers each, is listed in
docs/development.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import ClassVar, Optional

CUDA_SEMANTICS_ENV_VAR = "LIGHTNING_HPZ_EMULATE_CUDA_SEMANTICS"


def cuda_semantics_requested() -> bool:
    """Whether the environment asks for the emulation."""
    return os.environ.get(CUDA_SEMANTICS_ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


class CudaEvaluationContext:
    """Lightning's evaluation loops choose ``torch.inference_mode`` as on CUDA while installed. The latest strategy
    to install it owns it (two Trainers in one process); only the owner's ``uninstall`` puts Lightning's back."""

    _owner: ClassVar[Optional[CudaEvaluationContext]] = None
    _restore: ClassVar[Optional[Callable[[], None]]] = None

    @classmethod
    def install_if_requested(cls) -> Optional[CudaEvaluationContext]:
        if not cuda_semantics_requested():
            return None
        context = cls()
        context.install()
        return context

    def install(self) -> None:
        from lightning_hpz import lightning_internals

        if CudaEvaluationContext._owner is None:
            CudaEvaluationContext._restore = lightning_internals.evaluation_loops_see_no_gloo()
        CudaEvaluationContext._owner = self

    def uninstall(self) -> None:
        if CudaEvaluationContext._owner is not self or CudaEvaluationContext._restore is None:
            return
        CudaEvaluationContext._restore()
        CudaEvaluationContext._owner = CudaEvaluationContext._restore = None
