"""Two gaps in DeepSpeed's optimizer-less engine (the one Lightning builds for validate/test/predict), bridged.

Both live in ``DeepSpeedEngine`` (deepspeed/runtime/engine.py, DeepSpeed 0.19.8), and both are reached only under
ZeRO-3, where the engine's ``optimizer`` is a ``DeepSpeedZeRoOffload`` instead of a ZeRO-3 optimizer:

* ``_configure_zero_optimizer``, in its ``DummyOptim`` branch, calls ``self._set_zero_group_parallelism()`` when
  ``zero_hpz_partition_size > 1`` and the process has no hpZ group yet. Only ``DeepSpeedZeroOptimizer_Stage3`` has
  that method: ``AttributeError``. A ``deepspeed.zero.Init`` (``configure_model``) or a training engine that ran
  earlier in the process builds the group, so only a model built outside ``configure_model`` meets the error.
  :func:`ensure_hpz_groups` builds the group first, with the function the stage-3 optimizer itself calls.
* ``load_checkpoint`` without optimizer states reads the full weights from the ZeRO shards, then calls
  ``self.optimizer._restore_from_bit16_weights()``, which ``DeepSpeedZeRoOffload`` lacks: ``AttributeError``.
  Such an engine holds no fp32 master weights, so there is nothing to restore: :func:`optimizer_less_checkpoint_load`
  lends it a no-op for the duration of the load.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from lightning_hpz import collectives
from lightning_hpz.partitioning.deepspeed_patch import (
    TESTED_DEEPSPEED_BELOW,
    TESTED_DEEPSPEED_MIN,
    IncompatibleDeepSpeedError,
)

_INSTALL_TESTED = f"`pip install 'deepspeed>={TESTED_DEEPSPEED_MIN},<{TESTED_DEEPSPEED_BELOW}'`"


def _check_installed_deepspeed() -> Any:
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload  # noqa: F401 - the engine's stand-in
    from deepspeed.utils import groups

    for name in ("_create_zero_param_parallel_group", "_get_zero_param_intra_parallel_group"):
        if not callable(getattr(groups, name, None)):
            raise IncompatibleDeepSpeedError(
                f"DeepSpeed has no `deepspeed.utils.groups.{name}`, which lightning_hpz uses to build hpZ groups for "
                f"validate/test/predict engines. Install a tested release: {_INSTALL_TESTED}."
            )
    return groups


_groups = _check_installed_deepspeed()
_RESTORE = "_restore_from_bit16_weights"


def engine_builds_hpz_groups() -> bool:
    """True once DeepSpeed's engine has the method its optimizer-less branch calls (the upstream fix)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    return hasattr(DeepSpeedEngine, "_set_zero_group_parallelism")


def ensure_hpz_groups(partition_size: int) -> None:
    """Make the hpZ groups of ``partition_size`` ranks exist before an optimizer-less engine is built."""
    if partition_size <= 1 or engine_builds_hpz_groups():
        return
    existing = _groups._get_zero_param_intra_parallel_group()
    if existing is not None and collectives.world_size(existing) == min(partition_size, collectives.world_size()):
        return
    # Through the module attribute: lightning_hpz's wrapper (deepspeed_patch) rebuilds groups of another size.
    _groups._create_zero_param_parallel_group(partition_size)


@contextlib.contextmanager
def optimizer_less_checkpoint_load(engine: Any) -> Iterator[None]:
    """Let ``engine.load_checkpoint`` finish on an engine whose ZeRO-3 stand-in optimizer has no fp32 weights."""
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None or hasattr(optimizer, _RESTORE):
        yield
        return
    setattr(optimizer, _RESTORE, lambda: None)
    try:
        yield
    finally:
        delattr(optimizer, _RESTORE)
