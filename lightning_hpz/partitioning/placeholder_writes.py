"""Writes into ZeRO-3 parameters outside the engine reach their shards instead of vanishing into the placeholder.

Under ZeRO-3 a parameter built inside ``zero.Init`` (``fabric.init_module()``) keeps an empty placeholder as its
data; its values live in shards across the ranks. Code written for other strategies re-initialises or loads the model
after building it: LitGPT's ``initialize_weights`` calls every module's ``reset_parameters`` (``nn.init.normal_`` on
each weight), a fine-tuning script calls ``model.load_state_dict(full_state_dict)``. On the placeholder an in-place
``normal_`` is a no-op without a word, and a load fails on the shape ``[0]``.

While :func:`writes_reach_shards` holds, such parameters answer shape questions with their whole shape, and an in-place
write (``normal_``, ``zero_``, ``copy_``, an ``nn.init`` function, ...) runs on the gathered parameter inside
``deepspeed.zero.GatheredParameters`` with rank 0 as the writer: every rank must make the same writes, as they do when
they run the same initialisation or load the same file. A write through ``param.data`` bypasses this (``.data`` is a
plain tensor): the first read of ``.data`` warns.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import deepspeed
import torch
from torch import nn

from lightning_hpz.partitioning.sharded_parameters import full_shape, is_partitioned

# in-place methods that change bookkeeping, not values: run as they are
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad", "set_", "resize_", "detach_"})
_SHAPE_QUERIES = frozenset({torch.Tensor.dim, torch.Tensor.ndimension, torch.Tensor.size, torch.Tensor.numel,
                            torch.Tensor.nelement, torch.Tensor.shape.__get__, torch.Tensor.ndim.__get__})  # fmt: skip
_DATA_READ = torch.Tensor.data.__get__


class WriteWarning(UserWarning):
    """A ZeRO-3 placeholder's ``.data`` was read where writes through it would be lost."""


def _is_write(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    return name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITES


class _ShardedParameter(nn.Parameter):
    """A partitioned parameter while :func:`writes_reach_shards` holds (its class is swapped back afterwards)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # the tensor acted on: first positional, or `tensor=` (nn.init functions pass it by keyword)
        target = args[0] if args else kwargs.get("tensor")
        sharded = isinstance(target, _ShardedParameter) and target.ds_status.name != "AVAILABLE"
        if sharded and _is_write(func):
            return _write_gathered(target, func, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            if sharded and func in _SHAPE_QUERIES and args:
                return func(torch.empty(full_shape(target), device="meta"), *args[1:], **kwargs)
            if sharded and func == _DATA_READ:
                warnings.warn(
                    f"`.data` of a ZeRO-3 parameter of shape {tuple(full_shape(target))} is an empty placeholder: "
                    "writes through it are lost. Write to the parameter itself (for example `nn.init.normal_(p)` or "
                    "`p.copy_(...)` under `torch.no_grad()`), which reaches its shards.",
                    WriteWarning,
                    stacklevel=3,
                )
            return func(*args, **kwargs)


def _write_gathered(target: _ShardedParameter, func: Any, args: tuple, kwargs: dict) -> Any:
    # The write runs with `target` a plain parameter again, so that other tensor-likes keep their own handling (a
    # lazily loaded source tensor materialises itself through its __torch_function__).
    target.__class__ = nn.Parameter
    try:
        with deepspeed.zero.GatheredParameters([target], modifier_rank=0):
            return func(*args, **kwargs)
    finally:
        target.__class__ = _ShardedParameter


@contextmanager
def writes_reach_shards(params: Iterable[nn.Parameter]) -> Iterator[None]:
    """Within: in-place writes to the partitioned ones among ``params`` go to their shards (see the module)."""
    swapped = [p for p in params if is_partitioned(p) and type(p) is nn.Parameter]
    for param in swapped:
        param.__class__ = _ShardedParameter
    try:
        yield
    finally:
        for param in swapped:
            param.__class__ = nn.Parameter


class OpenWrites:
    """:func:`writes_reach_shards` held open from one call to another (``fabric.init_module()`` until set-up)."""

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        params = list(params)
        self._ids = {id(param) for param in params}
        self._context = writes_reach_shards(params)
        self._context.__enter__()

    def covers(self, module: nn.Module) -> bool:
        """Whether ``module`` has a parameter this window holds open."""
        return any(id(param) in self._ids for param in module.parameters())

    def close(self) -> None:
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None


@contextmanager
def registered_parameters() -> Iterator[list[nn.Parameter]]:
    """The parameters registered on any module while inside (the model ``fabric.init_module()`` builds)."""
    found: list[nn.Parameter] = []

    def note(module: nn.Module, name: str, param: Any) -> None:
        if isinstance(param, nn.Parameter):
            found.append(param)

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(note)
    try:
        yield found
    finally:
        handle.remove()


def loads_reach_shards(module: nn.Module, after_load: Callable[[], Any]) -> None:
    """Make ``module.load_state_dict`` write whole tensors into the shards of partitioned parameters (an instance
    override), then call ``after_load``. Entries that are placeholders themselves (DeepSpeed's own checkpoint load,
    which restores the shards separately) load as before, without ``after_load``."""
    load = module.load_state_dict

    def load_state_dict(state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        # entries may be tensor-likes that load on first use (LitGPT's lazy_load): read their shape only
        whole = [
            param
            for name, param in module.named_parameters(remove_duplicate=False)
            if math.prod(getattr(state_dict.get(name), "shape", (0,))) > 0
        ]
        with writes_reach_shards(whole):
            result = load(state_dict, *args, **kwargs)
        if whole:
            after_load()
        return result

    module.load_state_dict = load_state_dict
