"""Make DeepSpeed's ``cpu_adam`` op ready before any rank needs it when the optimizer is offloaded.

With ``offload_optimizer`` DeepSpeed steps with ``DeepSpeedCPUAdam``, which JIT-compiles ``cpu_adam`` into the
torch-extensions cache on first use (minutes on a small machine, with nothing printed); a rank killed
during that build leaves a lock every later run waits on. It is built or loaded here under the protection of
:mod:`extension_build`. There is no fallback without a compiler, so that stops the run with what to install.
"""

from __future__ import annotations

from typing import Any

from lightning_hpz.partitioning.cpu_comm_op import INSTALL_BUILD_TOOLS
from lightning_hpz.partitioning.extension_build import Announce, build_or_load

OP_NAME = "cpu_adam"


class CpuAdamBuildError(RuntimeError):
    """``cpu_adam`` is needed (the optimizer is offloaded) and cannot be built here."""


def offloads_to_cpu_adam(config: dict[str, Any]) -> bool:
    """Whether DeepSpeed will step with ``DeepSpeedCPUAdam`` for this DeepSpeed config (optimizer offloaded)."""
    offload = config.get("zero_optimization", {}).get("offload_optimizer") or {}
    return offload.get("device", "none") in ("cpu", "nvme") and config.get("zero_force_ds_cpu_optimizer", True)


def prepare_cpu_adam_op(announce: Announce = print) -> str:
    """Build or load ``cpu_adam`` in this process; returns ``"loaded"`` or ``"built"``."""

    def refuse(missing: str) -> str:
        raise CpuAdamBuildError(
            f"{missing} not found, so DeepSpeed's {OP_NAME} op, which the offloaded optimizer (DeepSpeedCPUAdam) "
            f"needs, cannot be built. {INSTALL_BUILD_TOOLS}, or train without offload_optimizer."
        )

    description = "DeepSpeed's CPU Adam op for the offloaded optimizer"
    return build_or_load(OP_NAME, description, _load, refuse, announce, build_time="5-10 minutes")


def _load() -> None:
    from deepspeed.ops.op_builder import CPUAdamBuilder  # the builder DeepSpeedCPUAdam itself loads

    CPUAdamBuilder().load(verbose=False)  # cached per process: DeepSpeedCPUAdam then reuses it
