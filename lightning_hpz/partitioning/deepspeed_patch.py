"""The one place that reaches into DeepSpeed's ZeRO-3 internals, guarded.

Two functions of ``deepspeed.runtime.zero.partition_parameters.Init`` are wrapped, never rewritten:

* ``_partition_param_sec`` writes a parameter's secondary (hpZ) shard. After it, the active
  :class:`~lightning_hpz.partitioning.ordering.CopyOrdering` orders the copy; DeepSpeed's own host-blocking
  synchronize (``resolves_data_dependency`` gate, PR #5216) is held off so each mode does exactly what it says,
  whatever the installed version does.
* ``_convert_to_deepspeed_param`` equips each parameter with ``all_gather_coalesced``, the only gather that reads
  secondary shards (called by the prefetch coordinator inside its all-gather stream context). Its result is wrapped so
  that the gathering stream first waits for the copies of the shards it reads.

The wrappers are applied when this module is imported; until a strategy installs an ordering (and for plain
DeepSpeed use next to this package) they call straight through.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from packaging.version import Version

from lightning_hpz.partitioning.emulation import EmulatedAsyncDevice
from lightning_hpz.partitioning.ordering import CopyOrdering

# The DeepSpeed releases this package was tested against; the patch refuses others rather than guess.
TESTED_DEEPSPEED_MIN = Version("0.16.0")
TESTED_DEEPSPEED_BELOW = Version("0.20.0")


class IncompatibleDeepSpeedError(ImportError):
    """The installed DeepSpeed lacks a function this package wraps, or is outside the tested range."""


def _undecorated(function: Any) -> Any:
    """The function under decorators such as DeepSpeed's ``instrument_w_nvtx``, which does not set ``__wrapped__``."""
    while True:
        inner = getattr(function, "__wrapped__", None)
        if inner is None:
            cells = [cell.cell_contents for cell in (getattr(function, "__closure__", None) or ())]
            inner = next((c for c in cells if inspect.isfunction(c)), None)
        if inner is None:
            return function
        function = inner


def _check_installed_deepspeed() -> Any:
    try:
        import deepspeed
        from deepspeed.runtime.zero import partition_parameters
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise IncompatibleDeepSpeedError(
            f"lightning_hpz needs DeepSpeed ({err}). Install it with `pip install 'deepspeed>={TESTED_DEEPSPEED_MIN},"
            f"<{TESTED_DEEPSPEED_BELOW}'`."
        ) from err
    version = Version(Version(deepspeed.__version__).base_version)
    if not TESTED_DEEPSPEED_MIN <= version < TESTED_DEEPSPEED_BELOW:
        raise IncompatibleDeepSpeedError(
            f"DeepSpeed {deepspeed.__version__} is outside the range lightning_hpz was tested with "
            f"(>={TESTED_DEEPSPEED_MIN},<{TESTED_DEEPSPEED_BELOW}). Install a tested release with "
            f"`pip install 'deepspeed>={TESTED_DEEPSPEED_MIN},<{TESTED_DEEPSPEED_BELOW}'`."
        )
    required = {
        "_partition_param_sec": ("self", "param", "buffer", "has_been_updated"),
        "_convert_to_deepspeed_param": ("self", "param"),
    }
    for name, parameters in required.items():
        target = getattr(partition_parameters.Init, name, None)
        if target is None or tuple(inspect.signature(_undecorated(target)).parameters)[: len(parameters)] != parameters:
            raise IncompatibleDeepSpeedError(
                f"DeepSpeed {deepspeed.__version__} has no `Init.{name}{parameters}`, which lightning_hpz wraps to "
                "order hpZ secondary copies. Install a tested release: "
                f"`pip install 'deepspeed>={TESTED_DEEPSPEED_MIN},<{TESTED_DEEPSPEED_BELOW}'`."
            )
    from deepspeed.utils import groups

    for name in ("_create_zero_param_parallel_group", "_get_zero_param_intra_parallel_group_world_size"):
        if not callable(getattr(groups, name, None)) or not hasattr(groups, "_ZERO_PARAM_INTRA_PARALLEL_GROUP"):
            raise IncompatibleDeepSpeedError(
                f"DeepSpeed {deepspeed.__version__} has no `deepspeed.utils.groups.{name}`, which lightning_hpz wraps "
                "so that several hpZ models can live in one process. Install a tested release: "
                f"`pip install 'deepspeed>={TESTED_DEEPSPEED_MIN},<{TESTED_DEEPSPEED_BELOW}'`."
            )
    return partition_parameters


_partition_parameters = _check_installed_deepspeed()
_ORIGINAL_PARTITION_PARAM_SEC = _partition_parameters.Init._partition_param_sec
_ORIGINAL_CONVERT_TO_DEEPSPEED_PARAM = _partition_parameters.Init._convert_to_deepspeed_param
_groups = _partition_parameters.groups
_ORIGINAL_CREATE_HPZ_GROUP = _groups._create_zero_param_parallel_group
_active: dict[str, Any] = {"ordering": None, "emulated_device": None}


def deepspeed_accelerator() -> Any:
    """DeepSpeed's accelerator object, looked up the way partition_parameters looks it up."""
    return _partition_parameters.get_accelerator()


def active_ordering() -> CopyOrdering | None:
    return _active["ordering"]


def install(mode: str, emulate_async_copy: bool = False) -> CopyOrdering:
    """Make ``mode`` the ordering of every secondary-partition copy and gather in this process from now on."""
    _wrap_deepspeed()
    device = EmulatedAsyncDevice() if emulate_async_copy else deepspeed_accelerator()
    ordering = CopyOrdering(mode, device)
    _active.update(ordering=ordering, emulated_device=device if emulate_async_copy else None)
    return ordering


def uninstall() -> None:
    """Deactivate the ordering: the wrappers stay in place and call straight through to DeepSpeed."""
    _active.update(ordering=None, emulated_device=None)


def _wrap_deepspeed() -> None:
    # Done at import, so parameters converted by a `deepspeed.zero.Init` entered before the Trainer exists (as some
    # scripts do) carry the ordered gather too. Idempotent.
    init_cls = _partition_parameters.Init
    if init_cls._partition_param_sec is _ORIGINAL_PARTITION_PARAM_SEC:
        init_cls._partition_param_sec = _ordered_partition_param_sec
        init_cls._convert_to_deepspeed_param = _convert_with_ordered_gather
        _groups._create_zero_param_parallel_group = _create_or_reuse_hpz_group


def _create_or_reuse_hpz_group(group_size: int) -> None:
    """DeepSpeed builds the hpZ groups once per process and asserts on a second model (fit, then validate; or a
    second Trainer): reuse the groups when the size is the same, build new ones when it differs."""
    if _groups._ZERO_PARAM_INTRA_PARALLEL_GROUP is not None:
        world_size = torch.distributed.get_world_size()
        if _groups._get_zero_param_intra_parallel_group_world_size() == min(group_size, world_size):
            return
        _groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None  # models built earlier keep their own group objects
    _ORIGINAL_CREATE_HPZ_GROUP(group_size)


@contextlib.contextmanager
def _deepspeed_copy_sync_held_off() -> Iterator[None]:
    """Make DeepSpeed's ``resolves_data_dependency`` gate skip its own synchronize for the duration of one call."""
    accelerator = deepspeed_accelerator()
    shadowed = "resolves_data_dependency" in vars(accelerator)
    previous = vars(accelerator).get("resolves_data_dependency")
    accelerator.resolves_data_dependency = lambda: True
    try:
        yield
    finally:
        if shadowed:
            accelerator.resolves_data_dependency = previous
        else:
            del accelerator.resolves_data_dependency


def _write_stamp(param: torch.nn.Parameter) -> tuple[int, int] | None:
    # A new shard object, or any in-place write to the old one, changes the stamp: that is how a copy is detected
    # without repeating DeepSpeed's own decision of when to write.
    secondary = getattr(param, "ds_secondary_tensor", None)
    return None if secondary is None else (id(secondary), secondary._version)


def _ordered_partition_param_sec(self: Any, param: Any, buffer: Any = None, has_been_updated: bool = False) -> None:
    ordering: CopyOrdering | None = _active["ordering"]
    if ordering is None:
        return _ORIGINAL_PARTITION_PARAM_SEC(self, param, buffer, has_been_updated)
    before = _write_stamp(param)
    with _deepspeed_copy_sync_held_off():
        _ORIGINAL_PARTITION_PARAM_SEC(self, param, buffer, has_been_updated)
    secondary = param.ds_secondary_tensor
    if secondary is None or _write_stamp(param) == before:
        return None
    emulated: EmulatedAsyncDevice | None = _active["emulated_device"]
    if emulated is not None:
        emulated.defer_copy(secondary)
    ordering.after_secondary_copy(secondary)
    return None


def _convert_with_ordered_gather(self: Any, param: Any) -> None:
    _ORIGINAL_CONVERT_TO_DEEPSPEED_PARAM(self, param)
    gather = getattr(param, "all_gather_coalesced", None)
    if gather is None:
        raise IncompatibleDeepSpeedError(
            "DeepSpeed's `Init._convert_to_deepspeed_param` no longer sets `param.all_gather_coalesced`; "
            "lightning_hpz cannot order hpZ gathers with this version. Install a tested DeepSpeed release: "
            f"`pip install 'deepspeed>={TESTED_DEEPSPEED_MIN},<{TESTED_DEEPSPEED_BELOW}'`."
        )

    def all_gather_coalesced(params: Any, *args: Any, **kwargs: Any) -> Any:
        params = list(params)
        ordering: CopyOrdering | None = _active["ordering"]
        if ordering is not None:
            ordering.before_secondary_gather(
                p.ds_secondary_tensor for p in params if getattr(p, "ds_secondary_tensor", None) is not None
            )
        return gather(params, *args, **kwargs)

    param.all_gather_coalesced = all_gather_coalesced


_wrap_deepspeed()
