"""Destroy the gloo process groups before the interpreter shuts down, after a run that ended normally.

A process that exits without ``destroy_process_group`` leaves gloo's worker threads holding finished asynchronous
work (DeepSpeed's ZeRO gathers are asynchronous, and so is the preemption flag's reduction), whose tensors keep Python
references. Freed during interpreter finalization, they abort the process: ``terminate called without an active
exception``, exit status -6 (SIGABRT) after a run that trained and saved everything (pytorch/pytorch#190489; seen
here in two of six runs of the test suite, each time in one of its two-process launches). torch recommends calling
``destroy_process_group`` at the end; Lightning does not, so the strategy does it at exit, for gloo only, and only
when the process is not leaving on an uncaught exception: a destroy while a peer still waits in a collective can
block, and NCCL's needs every rank (torchtitan destroys on success only, for the same reason).
"""

from __future__ import annotations

import atexit
import sys

import torch.distributed as dist

from lightning_hpz import collectives

_registered = False


def destroy_gloo_groups_at_exit() -> None:
    """Arrange :func:`destroy_gloo_groups` to run at interpreter exit (once per process)."""
    global _registered
    if not _registered:
        atexit.register(destroy_gloo_groups)
        _registered = True


def destroy_gloo_groups() -> bool:
    """Destroy the process groups now when the default one is gloo and no uncaught exception is ending the process;
    with another backend, only this package's own gloo control groups. Returns whether the default group went."""
    if not collectives.is_distributed() or _leaving_on_an_exception():
        return False
    if "gloo" in str(dist.get_backend()).lower():
        dist.destroy_process_group()
        return True
    collectives.destroy_control_groups()
    return False


def _leaving_on_an_exception() -> bool:
    # Python records an uncaught exception in sys.last_value (3.12+: also sys.last_exc) before the atexit handlers run
    return getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None
