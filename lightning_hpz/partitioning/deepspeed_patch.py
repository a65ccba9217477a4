"""The one place that reaches into DeepSpeed's ZeRO-3 internals, guarded.

Two functions of ``deepspeed.runtime.zero.partition_parameters.Init`` are wrapped, never rewritten:

* ``_partition_param_sec`` writes a parameter's secondary (hpZ) shard. After it, the active
  :class:`~lightning_hpz.partitioning.ordering.CopyOrdering` orders the copy; DeepSpeed's own host-blocking
  synchronize (``resolves_data_dependency`` gate, PR #5216) is held off so each mode does exactly what it says,
  whatever the installed version does.
  Before DeepSpeed 0.19.5 it also crashed on a parameter smaller than its secondary group's padded slices (a
  one-element bias: DeepSpeed #6659, fixed by PR #8210); those releases get the fix here (:func:`_past_end_safe`).
  Before 0.18.3 it was never told that a parameter had been written under ``GatheredParameters(modifier_rank=...)``
  (DeepSpeed #7606, #7130), so the copy kept the old weights; those releases rewrite it at every release here.
* ``_convert_to_deepspeed_param`` equips each parameter with ``all_gather_coalesced``, the only gather that reads
  secondary shards (called by the prefetch coordinator inside its all-gather stream context). Its result is wrapped so
  that the gathering stream first waits for the copies of the shards it reads.

Nothing is patched when this module is imported. :func:`install` applies the wrappers when a strategy is set up and
:func:`uninstall` removes them at its teardown, so plain DeepSpeed used later in the same process runs as shipped,
except that on the releases with DeepSpeed #6659 or #7606 the secondary write keeps their fixes (a model partitioned
under hpZ is used after its strategy's teardown, and would crash or go stale without them).
Parameters converted before :func:`install` (a ``deepspeed.zero.Init`` entered earlier) are found at setup by
:mod:`lightning_hpz.partitioning.converted_parameters`.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Iterator
from typing import Any, Optional

import torch
from packaging.version import Version

from lightning_hpz.partitioning.copy_sync_gate import copy_sync_held_off, remove_gates
from lightning_hpz.partitioning.emulation import EmulatedAsyncDevice
from lightning_hpz.partitioning.ordering import CopyOrdering

# The DeepSpeed releases this package was tested against; the patch refuses others rather than guess.
TESTED_DEEPSPEED_MIN = Version("0.16.9")
TESTED_DEEPSPEED_BELOW = Version("0.20.0")
# DeepSpeed #6659: _partition_param_sec narrows past the end of a parameter smaller than its secondary slice offsets.
SECONDARY_PAST_END_FIXED = Version("0.19.5")
# DeepSpeed #7606 (fixed by #7707): Init._partition dropped has_been_updated on its way to _partition_param_sec.
SECONDARY_UPDATE_PASSED = Version("0.18.3")


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


def _installed_deepspeed_version() -> Version:
    import deepspeed

    return Version(Version(deepspeed.__version__).base_version)


def _past_end_safe(partition_param_sec: Any) -> Any:
    """``partition_param_sec`` (DeepSpeed's own, before 0.19.5) made safe for a parameter that ends before this rank's
    secondary slice starts: stock code narrows the flat parameter at that offset and raises ``IndexError: start out
    of range``. Such a rank copies nothing; the call sees the parameter padded to its aligned size (the copy is still
    DeepSpeed's), and the slice, all padding, is zeroed as 0.19.5 does."""

    def past_end_safe(self: Any, param: Any, buffer: Any = None, has_been_updated: bool = False) -> None:
        secondary_start = self._aligned_size(param) // self.num_ranks_in_param_group * self.rank_in_group
        kept = param.ds_secondary_tensor is not None and not has_been_updated  # stock code returns at once
        available = param.ds_status is _partition_parameters.ZeroParamStatus.AVAILABLE
        if secondary_start <= param.ds_numel or kept or not available:
            return partition_param_sec(self, param, buffer, has_been_updated)
        whole = param.data
        # without gradients: a view of the padded parameter would give autograd the padded shape to expect
        with torch.no_grad():
            param.data = torch.zeros(self._aligned_size(param), dtype=whole.dtype, device=whole.device)
            param.data[: param.ds_numel].copy_(whole.reshape(-1))
            try:
                partition_param_sec(self, param, buffer, has_been_updated)
            finally:
                param.data = whole
            if param.ds_secondary_tensor is not None:
                param.ds_secondary_tensor.zero_()
        return None

    return past_end_safe


def _always_updated(partition_param_sec: Any) -> Any:
    """``partition_param_sec`` rewriting the secondary copy at every release of a gathered parameter: where DeepSpeed
    does not say whether the parameter was written meanwhile, a copy from the whole parameter (local, 1/hpZ of it) is
    the one that is right either way."""

    def always_updated(self: Any, param: Any, buffer: Any = None, has_been_updated: bool = False) -> None:
        return partition_param_sec(self, param, buffer, True)

    return always_updated


def _stock_partition_param_sec(original: Any, version: Version) -> Any:
    """What this package calls as DeepSpeed's own secondary write: ``original``, with the bugs of ``version`` fixed."""
    if version < SECONDARY_PAST_END_FIXED:
        original = _past_end_safe(original)
    if version < SECONDARY_UPDATE_PASSED:
        original = _always_updated(original)
    return original


_partition_parameters = _check_installed_deepspeed()
_ORIGINAL_PARTITION_PARAM_SEC = _partition_parameters.Init._partition_param_sec
_STOCK_PARTITION_PARAM_SEC = _stock_partition_param_sec(_ORIGINAL_PARTITION_PARAM_SEC, _installed_deepspeed_version())
_ORIGINAL_CONVERT_TO_DEEPSPEED_PARAM = _partition_parameters.Init._convert_to_deepspeed_param
_groups = _partition_parameters.groups
_ORIGINAL_CREATE_HPZ_GROUP = _groups._create_zero_param_parallel_group
_active: dict[str, Any] = {"ordering": None, "emulated_device": None}
_patch_lock = threading.Lock()
# Marks a parameter's gather as ordered, and a parameter whose copies keep DeepSpeed's own synchronize.
ORDERED_GATHER_MARK = "_hpz_ordered_gather"
STOCK_COPY_SYNC_MARK = "_hpz_stock_copy_sync"


def deepspeed_accelerator() -> Any:
    """DeepSpeed's accelerator object, looked up the way partition_parameters looks it up."""
    return _partition_parameters.get_accelerator()


def active_ordering() -> CopyOrdering | None:
    return _active["ordering"]


def install(mode: str, emulate_async_copy: bool = False) -> CopyOrdering:
    """Wrap DeepSpeed and make ``mode`` the ordering of every secondary-partition copy and gather in this process,
    until :func:`uninstall`. Returns the active :class:`CopyOrdering` (its counters say what it did)."""
    device = EmulatedAsyncDevice() if emulate_async_copy else deepspeed_accelerator()
    ordering = CopyOrdering(mode, device)
    with _patch_lock:
        _wrap_deepspeed()
        _active.update(ordering=ordering, emulated_device=device if emulate_async_copy else None)
    return ordering


def uninstall(ordering: Optional[CopyOrdering] = None) -> None:
    """Deactivate the ordering and give DeepSpeed back its own functions.

    With ``ordering``, only if that one is still the active one (a stale owner's teardown leaves a newer one alone).
    Gathers of parameters converted meanwhile keep their wrapper, which calls straight through from now on.
    """
    with _patch_lock:
        if ordering is not None and _active["ordering"] is not ordering:
            return
        _active.update(ordering=None, emulated_device=None)
        _unwrap_deepspeed()
    remove_gates()


def is_wrapped() -> bool:
    return _partition_parameters.Init._partition_param_sec is _ordered_partition_param_sec


def _wrap_deepspeed() -> None:
    init_cls = _partition_parameters.Init
    if init_cls._partition_param_sec in (_ORIGINAL_PARTITION_PARAM_SEC, _STOCK_PARTITION_PARAM_SEC):
        init_cls._partition_param_sec = _ordered_partition_param_sec
        init_cls._convert_to_deepspeed_param = _convert_with_ordered_gather
        _groups._create_zero_param_parallel_group = _create_or_reuse_hpz_group


def _unwrap_deepspeed() -> None:
    init_cls = _partition_parameters.Init
    if init_cls._partition_param_sec is _ordered_partition_param_sec:
        # a model partitioned under hpZ outlives the strategy (used after fit): its later releases keep the fixes
        init_cls._partition_param_sec = _STOCK_PARTITION_PARAM_SEC
    if init_cls._convert_to_deepspeed_param is _convert_with_ordered_gather:
        init_cls._convert_to_deepspeed_param = _ORIGINAL_CONVERT_TO_DEEPSPEED_PARAM
    if _groups._create_zero_param_parallel_group is _create_or_reuse_hpz_group:
        _groups._create_zero_param_parallel_group = _ORIGINAL_CREATE_HPZ_GROUP


def _create_or_reuse_hpz_group(group_size: int) -> None:
    """DeepSpeed builds the hpZ groups once per process and asserts on a second model (fit, then validate; or a
    second Trainer): reuse the groups when the size is the same, build new ones when it differs."""
    if _groups._ZERO_PARAM_INTRA_PARALLEL_GROUP is not None:
        world_size = torch.distributed.get_world_size()
        if _groups._get_zero_param_intra_parallel_group_world_size() == min(group_size, world_size):
            return
        _groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None  # models built earlier keep their own group objects
    _ORIGINAL_CREATE_HPZ_GROUP(group_size)


def _deepspeed_copy_sync_held_off() -> Any:
    """Make DeepSpeed's ``resolves_data_dependency`` gate skip its own synchronize, on this thread, for one call."""
    return copy_sync_held_off(deepspeed_accelerator())


def _write_stamp(param: torch.nn.Parameter) -> tuple[int, int] | None:
    # A new shard object, or any in-place write to the old one, changes the stamp: that is how a copy is detected
    # without repeating DeepSpeed's own decision of when to write.
    secondary = getattr(param, "ds_secondary_tensor", None)
    return None if secondary is None else (id(secondary), secondary._version)


@contextlib.contextmanager
def _outside_inference_mode() -> Iterator[None]:
    """Leave ``torch.inference_mode`` (gradients stay off) for the duration of a secondary-shard write.

    Lightning evaluates under ``inference_mode`` on CUDA (``lightning/pytorch/loops/utilities.py``,
    ``_no_grad_context``), and DeepSpeed writes a secondary shard in whatever mode the forward runs: a shard allocated
    there is an inference tensor, which has no version counter and may never be written in place outside that mode.
    Frozen parameters keep their shards into training, where DeepSpeed rewrites them in place.
    """
    if not torch.is_inference_mode_enabled():
        yield
        return
    with torch.inference_mode(False), torch.no_grad():
        yield


def _drop_inference_secondary(param: Any) -> None:
    # A shard made under inference_mode before this module wrapped DeepSpeed: let DeepSpeed allocate a normal one.
    secondary = getattr(param, "ds_secondary_tensor", None)
    if secondary is not None and secondary.is_inference():
        param.ds_secondary_tensor = None


def _ordered_partition_param_sec(self: Any, param: Any, buffer: Any = None, has_been_updated: bool = False) -> None:
    with _outside_inference_mode():
        _drop_inference_secondary(param)
        return _write_secondary_in_order(self, param, buffer, has_been_updated)


def _write_secondary_in_order(self: Any, param: Any, buffer: Any, has_been_updated: bool) -> None:
    ordering: CopyOrdering | None = _active["ordering"]
    if ordering is None or getattr(param, STOCK_COPY_SYNC_MARK, False):
        return _STOCK_PARTITION_PARAM_SEC(self, param, buffer, has_been_updated)
    before = _write_stamp(param)
    with _deepspeed_copy_sync_held_off():
        _STOCK_PARTITION_PARAM_SEC(self, param, buffer, has_been_updated)
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
    param.all_gather_coalesced = ordered_gather(gather)


def ordered_gather(gather: Any) -> Any:
    """``gather`` (a parameter's ``all_gather_coalesced``) made to wait first for the copies of the shards it reads."""

    def all_gather_coalesced(params: Any, *args: Any, **kwargs: Any) -> Any:
        params = list(params)
        ordering: CopyOrdering | None = _active["ordering"]
        if ordering is not None:
            ordering.before_secondary_gather(
                p.ds_secondary_tensor for p in params if getattr(p, "ds_secondary_tensor", None) is not None
            )
        return gather(params, *args, **kwargs)

    setattr(all_gather_coalesced, ORDERED_GATHER_MARK, True)
    return all_gather_coalesced
