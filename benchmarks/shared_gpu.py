"""Several ranks on one GPU: NCCL refuses two ranks on the same device, so they talk over gloo with CUDA tensors.

torch's gloo backend takes CUDA tensors for some collectives and not for others. :func:`probe_gloo_cuda` tries each
collective ZeRO-3 issues, once, on a small CUDA tensor, and returns the exact error of every one that fails;
:func:`relay_through_host` then routes just those through host memory (a copy to the CPU on the calling stream, the
gloo collective, a copy back), so the run still goes through DeepSpeed's CUDA code path with real streams. The
results say which collectives were relayed and why, word for word.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

RELAYED = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "broadcast", "all_gather")
# the first parameter's name in each; "tensor_list" before "tensor": all_gather passes both, and writes the list
OUTPUT_KEYWORDS = ("output_tensor", "output", "tensor_list", "tensor")


def probe_gloo_cuda(device: torch.device) -> dict[str, str]:
    """Each collective of :data:`RELAYED` that gloo refuses with CUDA tensors, with its error message."""
    world = dist.get_world_size()
    trials: dict[str, Callable[[], Any]] = {
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(
            torch.zeros(world * 4, device=device), torch.ones(4, device=device)
        ),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
            torch.zeros(4, device=device), torch.ones(world * 4, device=device)
        ),
        "all_reduce": lambda: dist.all_reduce(torch.ones(4, device=device)),
        "broadcast": lambda: dist.broadcast(torch.ones(4, device=device), src=0),
        "all_gather": lambda: dist.all_gather(
            [torch.zeros(4, device=device) for _ in range(world)], torch.ones(4, device=device)
        ),
    }
    failures = {}
    for name, trial in trials.items():
        try:
            trial()
            torch.cuda.synchronize(device)
        except Exception as err:  # the exact error is the result
            failures[name] = f"{type(err).__name__}: {err}".strip()[:500]
        dist.barrier()  # a rank that failed early must not run ahead into the next trial
    return failures


class _Done:
    """What an ``async_op=True`` caller waits on after a relayed collective (it has already finished)."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def relay_through_host(names: list[str], relays: Callable[[torch.Tensor], bool] = lambda t: t.is_cuda) -> None:
    """Route the collectives ``names`` through host memory whenever they are handed tensors that ``relays``
    (CUDA tensors; the tests relay CPU tensors to check the relay itself)."""
    for name in names:
        original = getattr(dist, name)
        setattr(dist, name, _relayed(original, relays))
    _repoint_deepspeed_references(names)


def _repoint_deepspeed_references(names: list[str]) -> None:
    """DeepSpeed's torch backend keeps its own references to the two gathers/scatters ZeRO-3 issues most (taken when
    the process group started): point them at the relayed functions too."""
    try:
        from deepspeed.comm import comm
    except ImportError:
        return
    backend = getattr(comm, "cdb", None)
    for attribute, name in (("all_gather_function", "all_gather_into_tensor"),
                            ("reduce_scatter_function", "reduce_scatter_tensor")):  # fmt: skip
        if backend is not None and name in names and hasattr(backend, attribute):
            setattr(backend, attribute, getattr(dist, name))


def _relayed(original: Callable[..., Any], relays: Callable[[torch.Tensor], bool]) -> Callable[..., Any]:
    @functools.wraps(original)
    def relayed(*args: Any, **kwargs: Any) -> Any:
        tensors = [t for t in _tensors_in([*args, *kwargs.values()]) if relays(t)]
        if not tensors:
            return original(*args, **kwargs)
        async_op = kwargs.pop("async_op", False)
        # a copy to the host waits for the calling stream only, as gloo's own copy of a CUDA tensor does
        on_host = {id(t): t.to("cpu", copy=True) for t in tensors}
        original(*_swap(args, on_host), **_swap(kwargs, on_host))
        for output in _outputs(args, kwargs):  # inputs stay as the caller left them
            if id(output) in on_host:
                output.copy_(on_host[id(output)])
        return _Done() if async_op else None

    return relayed


def _tensors_in(values: list[Any]) -> list[torch.Tensor]:
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found += [item for item in value if isinstance(item, torch.Tensor)]
    return found


def _outputs(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """What each relayed collective writes: its first argument (a tensor, or a list of them for ``all_gather``)."""
    first = args[0] if args else next((kwargs[k] for k in OUTPUT_KEYWORDS if k in kwargs), None)
    return _tensors_in([first])


def _swap(structure: Any, on_host: dict[int, torch.Tensor]) -> Any:
    if isinstance(structure, torch.Tensor):
        return on_host.get(id(structure), structure)
    if isinstance(structure, dict):
        return {key: _swap(value, on_host) for key, value in structure.items()}
    if isinstance(structure, (list, tuple)):
        return type(structure)(_swap(item, on_host) for item in structure)
    return structure
