"""Make DeepSpeed's CPU communication op ready before any rank needs it, so a first run can never hang silently.

On CPU, DeepSpeed JIT-compiles ``deepspeed_shm_comm`` the first time a process group starts; it is built or loaded
here under the protection of :mod:`extension_build` (one build, announced, a stale lock removed). Without a C++
compiler the op is switched off: DeepSpeed then uses torch's own gloo collectives, which it supports
(``build_shm_op`` returns ``None`` for an op marked incompatible in ``deepspeed.ops.__compatible_ops__``).
"""

from __future__ import annotations

from lightning_hpz.partitioning.extension_build import Announce, build_or_load

OP_NAME = "deepspeed_shm_comm"
INSTALL_BUILD_TOOLS = (
    "Install a C++ compiler (Debian/Ubuntu: apt-get install g++; conda: conda install gxx) and ninja "
    "(pip install ninja)"
)


def prepare_cpu_comm_op(announce: Announce = print) -> str:
    """Build or load the op in this process; returns ``"loaded"``, ``"built"`` or ``"disabled"``."""

    def use_gloo(missing: str) -> str:
        _disable()
        announce(
            f"lightning_hpz: {missing} not found, so DeepSpeed's CPU communication op ({OP_NAME}) cannot be "
            f"built; using torch's gloo collectives instead (slower on many ranks). {INSTALL_BUILD_TOOLS} to use it."
        )
        return "disabled"

    description = "DeepSpeed's CPU communication op"
    return build_or_load(OP_NAME, description, _load, use_gloo, announce, build_time="1-4 minutes")


def _load() -> None:
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder  # what DeepSpeed's CPU accelerator builds

    ShareMemCommBuilder().load(verbose=False)  # cached per process: DeepSpeed's own load() then reuses it


def _disable() -> None:
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[OP_NAME] = False
