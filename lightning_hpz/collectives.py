"""Every collective this package issues goes through here, with its tensors on a device the process group accepts.

NCCL refuses CPU tensors and gloo has no CUDA reduce-scatter: a collective written with ``torch.tensor(...)`` on the
default device works in the CPU tests and crashes the first GPU run. One place decides the device from the group's
backend, so the CPU tests exercise the same code path a GPU run takes.
"""

from __future__ import annotations

import heapq
import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist

_REDUCE_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN", "product": "PRODUCT"}


def is_distributed() -> bool:
    """True once a default process group exists (one process without it is a world of one)."""
    return dist.is_available() and dist.is_initialized()


def world_size(group: Optional[Any] = None) -> int:
    return dist.get_world_size(group) if is_distributed() else 1


def rank(group: Optional[Any] = None) -> int:
    return dist.get_rank(group) if is_distributed() else 0


def collective_device(group: Optional[Any] = None) -> torch.device:
    """The device a tensor must be on for a collective over ``group``: this rank's GPU under NCCL, else the CPU."""
    if is_distributed() and "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reduce_op(op: str) -> Any:
    """torch's ``ReduceOp`` for ``op``, or a ValueError naming the choices (checked before any rank communicates)."""
    if op not in _REDUCE_OPS:
        raise ValueError(f"op={op!r}: choose one of {sorted(_REDUCE_OPS)}")
    return getattr(dist.ReduceOp, _REDUCE_OPS[op])


def all_reduce(tensor: torch.Tensor, op: str = "sum", group: Optional[Any] = None) -> torch.Tensor:
    """A reduced copy of ``tensor`` on ``tensor``'s own device; ``tensor`` itself is left unchanged."""
    reduce_op = _reduce_op(op)
    if not is_distributed():
        return tensor.clone()
    placed = tensor.detach().to(collective_device(group), copy=True)
    dist.all_reduce(placed, op=reduce_op, group=group)
    return placed.to(tensor.device)


def all_reduce_values(values: list[float], op: str = "sum", group: Optional[Any] = None) -> list[float]:
    """Reduce a few Python numbers across ranks in one collective (float64, so counts stay exact)."""
    reduced = all_reduce(torch.tensor(values, dtype=torch.float64), op=op, group=group)
    return reduced.tolist()


class PendingReduction:
    """An all-reduce of a few numbers on the default group, started now and read later (a step later).

    No group of its own: a world-wide side group would be a full mesh of connections (N - 1 sockets per rank, which
    fails at about a thousand ranks or under ``ulimit -n 1024``). Under gloo the numbers travel in host memory; under
    NCCL the reduction is queued behind the step's GPU work and its result copied to pinned host memory behind it,
    so starting it never waits, and reading it a step later waits only for GPU work of the step before (done by
    then). Read it at the same point on every rank (``result`` waits for the reduction the ranks started earlier).
    """

    def __init__(self, values: list[float], op: str = "sum") -> None:
        reduce_op = _reduce_op(op)
        self._values = torch.tensor(values, dtype=torch.float64)
        self._work: Optional[Any] = None
        self._copied: Optional[Any] = None  # under NCCL: the event after the copy to the host
        if not is_distributed():
            return
        device = collective_device()
        placed = self._values.to(device)
        self._work = dist.all_reduce(placed, op=reduce_op, async_op=True)
        if device.type == "cuda":
            self._work.wait()  # the current stream waits for the reduction; the host does not
            self._work = None
            self._values = placed.to("cpu", non_blocking=True)  # into pinned memory, behind the reduction
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self._values = placed

    def result(self) -> list[float]:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        return self._values.tolist()


def default_group_still_current() -> Any:
    """A test, ``() -> bool``, of whether the default process group of now is still the default one: False once it
    was destroyed (a script that never tears its strategy down, a test harness between tests)."""
    if not is_distributed():
        return lambda: False
    world = weakref.ref(dist.group.WORLD)
    return lambda: is_distributed() and dist.group.WORLD is world()


def all_gather_tensor(tensor: torch.Tensor, group: Optional[Any] = None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape on each), in rank order, on ``tensor``'s device."""
    if not is_distributed():
        return [tensor.clone()]
    placed = tensor.detach().to(collective_device(group), copy=True).contiguous()
    pieces = [torch.empty_like(placed) for _ in range(world_size(group))]
    dist.all_gather(pieces, placed, group=group)
    return [piece.to(tensor.device) for piece in pieces]


def all_gather_object(obj: Any, group: Optional[Any] = None) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order."""
    if not is_distributed():
        return [obj]
    gathered: list[Any] = [None] * world_size(group)
    _with_object_device(lambda: dist.all_gather_object(gathered, obj, group=group), group)
    return gathered


def gather_object(obj: Any, dst: int = 0, group: Optional[Any] = None) -> Optional[list[Any]]:
    """Every rank's picklable ``obj``, in rank order, on ``dst`` alone (None elsewhere): each rank sends its own
    object once, where an all-gather would hand every rank all ``world_size`` of them."""
    if not is_distributed():
        return [obj]
    gathered: Optional[list[Any]] = [None] * world_size(group) if rank(group) == dst else None
    _with_object_device(lambda: dist.gather_object(obj, gathered, group=group, group_dst=dst), group)
    return gathered


def broadcast_object(obj: Any, src: int = 0, group: Optional[Any] = None) -> Any:
    """``src``'s ``obj`` on every rank."""
    if not is_distributed():
        return obj
    holder = [obj]
    _with_object_device(lambda: dist.broadcast_object_list(holder, src=src, group=group), group)
    return holder[0]


def scatter_object(per_rank: Optional[list[Any]], src: int = 0, group: Optional[Any] = None) -> Any:
    """Rank ``src``'s ``per_rank[r]`` on each rank ``r`` (``per_rank`` is read on ``src`` alone, one object per rank):
    each rank receives its own object, where a broadcast would send every rank all ``world_size`` of them."""
    if not is_distributed():
        return per_rank[0]
    received: list[Any] = [None]
    sent = per_rank if rank(group) == src else None
    _with_object_device(lambda: dist.scatter_object_list(received, sent, group=group, group_src=src), group)
    return received[0]


def balanced_deal(weights: list[int], size: int) -> list[int]:
    """The rank of each item, for ``size`` ranks to share items of ``weights``: largest first (in their order among
    equals), each to the rank with the least weight so far, the lowest such rank; equal weights go round-robin. Rank 0
    deals once, O(items log size), and every rank's work comes out about even."""
    loads = [(0, rank) for rank in range(size)]  # a heap of (weight dealt, rank)
    ranks = [0] * len(weights)
    for index in sorted(range(len(weights)), key=lambda i: -weights[i]):
        load, rank = heapq.heappop(loads)
        ranks[index] = rank
        heapq.heappush(loads, (load + weights[index], rank))
    return ranks


def new_subgroups(rank_lists: list[list[int]]) -> Optional[Any]:
    """Create one group per list (every rank must call this with the same lists); returns this rank's group."""
    if not is_distributed():
        return None
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks=ranks)
        if rank() in ranks:
            mine = group
    return mine


def destroy_group(group: Optional[Any]) -> None:
    """Release a group made by :func:`new_subgroups` (its connections, its NCCL communicator)."""
    if group is not None and is_distributed():
        dist.destroy_process_group(group)


def gather_buffers(elements: int, group: Optional[Any] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A piece of ``elements`` bytes and the output for its all-gather over ``group``, both already written (a fresh
    host buffer's first-touch page faults are not transfer time), for :func:`timed_all_gather` to re-use."""
    device = collective_device(group)
    piece = torch.zeros(elements, dtype=torch.uint8, device=device)
    return piece, torch.zeros(elements * world_size(group), dtype=torch.uint8, device=device)


def timed_all_gather(
    elements: int, group: Optional[Any] = None, buffers: Optional[tuple[torch.Tensor, torch.Tensor]] = None
) -> float:
    """Seconds from a world-wide barrier to the end of this rank's all-gather of ``elements`` bytes per rank over
    ``group`` (device-synced), into ``buffers`` (from :func:`gather_buffers`) or new ones. Every rank of the world
    calls it at once, each with its own group: the groups start together, so ranks whose groups share a link share it
    for the whole measurement."""
    import time

    piece, output = buffers if buffers is not None else gather_buffers(elements, group)
    if piece.numel() != elements:
        raise ValueError(f"buffers hold {piece.numel()} bytes per rank, not the {elements} to gather")
    barrier()  # all groups start together: one group alone would find the shared link idle
    _synchronize(piece.device)
    start = time.perf_counter()
    if is_distributed():
        _all_gather_into(output, piece, group)
    _synchronize(piece.device)
    return time.perf_counter() - start


def _all_gather_into(output: torch.Tensor, piece: torch.Tensor, group: Optional[Any]) -> None:
    # the single-tensor form writes straight into ``output``; gloo's list form gathers into a temporary first
    single = getattr(dist, "all_gather_single", None)  # torch >= 2.13, every backend
    if single is not None:
        single(output, piece, group=group)
    elif output.device.type == "cuda":
        dist.all_gather_into_tensor(output, piece, group=group)
    else:  # gloo of older torch has no single-tensor all-gather
        dist.all_gather(list(output.chunk(world_size(group))), piece, group=group)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier(group: Optional[Any] = None) -> None:
    if is_distributed():
        dist.barrier(group=group)


def _with_object_device(call: Any, group: Optional[Any]) -> None:
    # Object collectives pickle into a tensor on torch.cuda.current_device() under NCCL: make sure that is this rank's.
    device = collective_device(group)
    if device.type == "cuda":
        with torch.cuda.device(device):
            call()
    else:
        call()


def abort_process_groups() -> None:
    """Abort every process group of this process, so peers waiting in a collective with this rank get an error now
    instead of at the timeout. No collective works in this process afterwards."""
    if not is_distributed():
        return
    try:
        # torch's private abort (documented for NCCL) closes gloo's connections too, so blocked peers raise
        dist.distributed_c10d._abort_process_group()
    except (AttributeError, RuntimeError, NotImplementedError):
        dist.destroy_process_group()


def default_store() -> Optional[Any]:
    """The key-value store the default process group was built on (it outlives an abort while referenced)."""
    return dist.distributed_c10d._get_default_store() if is_distributed() else None
