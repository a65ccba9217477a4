"""Load a DeepSpeed universal checkpoint into an engine that was configured without ``load_universal``, each rank
reading only its own part of every file.

Whether a resume needs the universal format is known only at load time (the checkpoint's world size), after
``deepspeed.initialize`` has parsed the config. ``DeepSpeedEngine.load_universal_checkpoint()`` reads the flag from
the engine's parsed config (``engine._config.load_universal_checkpoint``, DeepSpeed 0.19.x) on every load; this sets
it for one load and restores it. Checked at import that the installed DeepSpeed still reads it from there.

DeepSpeed's universal loader ``torch.load``s every parameter's whole merged files on every rank and keeps the rank's
slice: each rank reads the whole state S, N x S over the job. The merged files are uncompressed ``torch.save``
archives, so ``torch.load(mmap=True)`` maps them instead, and only the pages of the bytes a rank copies are read.
For the load only:

* ZeRO-3: the optimizer's ``load_hp_checkpoint_state`` (one parameter's flat state, this rank's equal part of it,
  the last part padded with zeros) is replaced by :func:`own_part`, which cuts the part first, reads its bytes with
  one ``pread`` at the offset the mapped tensor's archive gives, and pads only the part, where DeepSpeed pads the
  whole tensor with a ``torch.cat`` (a full read and copy) and then cuts.
* ZeRO-1/2 and the bf16 optimizer: each parameter's ``load_hp_checkpoint_state`` is DeepSpeed's own (it only slices
  and copies the fragment it needs), with the ``torch`` it calls replaced by one whose ``load`` maps.

Both are guarded by the digest of DeepSpeed's function source, for the releases whose functions were read for this
(:data:`STAGE3_READ`, :data:`FRAGMENT_READ`); another source loads as DeepSpeed ships it, saying why. What each rank
copied is counted in :class:`UniversalReads`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import math
import os
import re
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import deepspeed
import torch
from deepspeed import comm as dist
from deepspeed.checkpoint import universal_checkpoint
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_hpz.partitioning.deepspeed_patch import IncompatibleDeepSpeedError

_FLAG = "load_universal_checkpoint"

if "_config.load_universal_checkpoint" not in inspect.getsource(DeepSpeedEngine.load_universal_checkpoint):
    raise IncompatibleDeepSpeedError(
        "The installed DeepSpeed no longer reads `load_universal_checkpoint` from the engine's parsed config; "
        "lightning_hpz cannot resume on a different number of ranks with it. Install deepspeed<0.20."
    )

# sha256 (first 16 hex digits) of ``inspect.getsource`` of DeepSpeed's functions, by the releases read for this.
# ZeRO-3's: 0.18.9 and 0.19.8 partition a bare tensor file alike over the data-parallel (0.19: the parameter's
# partition) group; 0.16 and 0.17 take the slice of the node-local rank, which this does not reproduce.
STAGE3_READ = {"86a7249d824ec6e9": "0.18.9", "37391962878d2b79": "0.19.8"}
# ZeRO-1/2's: each reads every state file with one ``torch.load(path, weights_only=False)``, then only slices and copies
FRAGMENT_READ = {"c5dfd6f7bb8e7650": "0.16.9, 0.17.6", "8b2c75d40c500346": "0.18.9", "981405e95ffd4c73": "0.19.8"}
FRAGMENT_GROUPS = ("bit16_groups", "bf16_groups")  # ZeRO-1/2's and the bf16 optimizer's parameters, by group


def _source_digest(function: Any) -> str:
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()[:16]


def _unread_reason(function: Any, read: dict[str, str], name: str) -> str:
    """Why the installed ``function`` is not one of those ``read``: empty when it is."""
    if _source_digest(function) in read:
        return ""
    return (
        f"DeepSpeed {deepspeed.__version__}'s `{name}` is not the one read for partial reads (DeepSpeed "
        f"{', '.join(read.values())}): each rank reads every parameter's whole files"
    )


_STAGE3_LOAD = DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state
STAGE3_REASON = _unread_reason(_STAGE3_LOAD, STAGE3_READ, "DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state")
FRAGMENT_REASON = _unread_reason(
    universal_checkpoint.load_hp_checkpoint_state, FRAGMENT_READ, "universal_checkpoint.load_hp_checkpoint_state"
)


@dataclass
class UniversalReads:
    """What one rank's universal load read: the bytes it copied out of the merged files (its own parts, without
    padding), the files it mapped, and the files DeepSpeed read whole (``fallback`` says why, when it did)."""

    bytes_copied: int = 0
    files_mapped: int = 0
    files_read_whole: int = 0
    fallback: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


@contextmanager
def universal_loading(engine: Any, reads: Optional[UniversalReads] = None) -> Iterator[UniversalReads]:
    """Within this block, ``engine.load_checkpoint`` reads the universal layout (``zero/<param>/fp32.pt`` ...), each
    rank only its own part of each file where the installed DeepSpeed allows; yields the count of what it read."""
    reads = reads if reads is not None else UniversalReads()
    config = engine._config
    before = getattr(config, _FLAG)
    setattr(config, _FLAG, True)
    try:
        with _partial_reads(engine.optimizer, reads):
            yield reads
    finally:
        setattr(config, _FLAG, before)


def _partial_reads(optimizer: Any, reads: UniversalReads) -> contextlib.AbstractContextManager:
    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        return _stage3_parts(optimizer, reads) if not STAGE3_REASON else _whole_files(reads, STAGE3_REASON)
    if any(getattr(optimizer, name, None) for name in FRAGMENT_GROUPS):
        return _mapped_fragments(optimizer, reads) if not FRAGMENT_REASON else _whole_files(reads, FRAGMENT_REASON)
    return contextlib.nullcontext()  # no ZeRO optimizer (module-only engine): DeepSpeed reads no universal state


@contextmanager
def _whole_files(reads: UniversalReads, reason: str) -> Iterator[None]:
    rank_zero_info(f"Universal load: {reason}.")
    reads.fallback = reason
    yield


@contextmanager
def _stage3_parts(optimizer: Any, reads: UniversalReads) -> Iterator[None]:
    # an instance attribute shadows the class's method for this optimizer alone; deleting it restores the method
    optimizer.load_hp_checkpoint_state = types.MethodType(_stage3_own_part(reads), optimizer)
    try:
        yield
    finally:
        del optimizer.load_hp_checkpoint_state


def _stage3_own_part(reads: UniversalReads) -> Callable[..., torch.Tensor]:
    def load_hp_checkpoint_state(self: Any, folder: str, key: str, param: Any = None) -> torch.Tensor:
        """DeepSpeed's ``load_hp_checkpoint_state`` (ZeRO-3), reading only this rank's part of the file."""
        path = os.path.join(folder, f"{key}.pt")
        loaded = torch.load(path, weights_only=False, mmap=True)
        if _sliced_by_layout(loaded, param):  # DeepSpeed's own slicing, over the whole file
            reads.files_read_whole += 1
            return _STAGE3_LOAD(self, folder, key, param=param)
        flat = (loaded[universal_checkpoint.PARAM] if isinstance(loaded, dict) else loaded).view(-1)
        group = self._get_param_partition_group(param) if param is not None else self.dp_process_group
        rank, size = dist.get_rank(group=group), dist.get_world_size(group=group)
        with open(path, "rb") as stream:  # the archive's index and the part's bytes, read through one descriptor
            part, held = own_part(flat, rank, size, _range_reader(stream, flat))
        reads.bytes_copied += held * flat.element_size()
        reads.files_mapped += 1
        return part

    return load_hp_checkpoint_state


def _sliced_by_layout(loaded: Any, param: Any) -> bool:
    """An expert (AutoEP) or tensor-parallel (AutoTP) parameter, whose part DeepSpeed cuts by its layout first."""
    expert = isinstance(loaded, dict) and loaded.get(universal_checkpoint.EP_IS_EXPERT_PARAM, False)
    return bool(expert or (param is not None and universal_checkpoint._get_param_uc_restore_meta(param)))


# read(into, flat, start): fill ``into`` with elements ``start`` on of ``flat``
ReadRange = Callable[[torch.Tensor, torch.Tensor, int], None]


def own_part(
    flat: torch.Tensor, rank: int, world_size: int, read: Optional[ReadRange] = None
) -> tuple[torch.Tensor, int]:
    """Part ``rank`` of ``flat`` cut into ``world_size`` equal parts, the last ones padded with zeros (DeepSpeed's
    ZeRO-3 partition of a flat parameter), and how many elements of ``flat`` it holds. Only those are read, by
    ``read`` (default: copied from ``flat``; from a mapped file, that reads their pages and the kernel's read-ahead)."""
    size = math.ceil(flat.numel() / world_size)
    start = min(rank * size, flat.numel())
    held = min(size, flat.numel() - start)
    part = torch.zeros(size, dtype=flat.dtype)
    if held:
        (read or _copy_range)(part[:held], flat, start)
    return part, held


def _copy_range(into: torch.Tensor, flat: torch.Tensor, start: int) -> None:
    into.copy_(flat.narrow(0, start, into.numel()))


def _range_reader(stream: Any, flat: torch.Tensor) -> Optional[ReadRange]:
    """Reads ``flat``'s elements from the archive open in ``stream`` with one ``pread`` (None where its bytes cannot
    be placed): a page fault on the mapping would read ahead a window past the part (``read_ahead_kb``, several MiB;
    tens of MiB on Lustre clients), more than a whole part of most parameters at N = 1,024, while faults without
    read-ahead read page by page. The tensor's storage is the archive's one data record, stored uncompressed at the
    offset the archive's index gives (as ``torch.load(mmap=True)`` itself finds it)."""
    try:
        archive = torch._C.PyTorchFileReader(stream)
        (record,) = [name for name in archive.get_all_records() if re.fullmatch(r"([^/]+/)?data/\d+", name)]
        if archive.get_record_size(record) != flat.untyped_storage().nbytes():
            return None
        offset = archive.get_record_offset(record) + flat.storage_offset() * flat.element_size()
    except (RuntimeError, ValueError, AttributeError):  # not one data record, not a zip archive; a torch without it
        return None
    return functools.partial(_pread_range, stream.fileno(), offset)


def _pread_range(descriptor: int, offset: int, into: torch.Tensor, flat: torch.Tensor, start: int) -> None:
    buffer = memoryview(into.view(torch.uint8).numpy())
    offset += start * flat.element_size()
    if hasattr(os, "posix_fadvise"):  # Linux: these bytes, no read-ahead past them
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_RANDOM)
    done = 0
    while done < len(buffer):
        count = os.preadv(descriptor, [buffer[done:]], offset + done)
        if count == 0:
            raise EOFError(f"the archive ends before its tensor's data does (descriptor {descriptor})")
        done += count


class _MappingTorch:
    """``torch`` as DeepSpeed's universal loader sees it during a load: ``load`` maps the file instead of reading it."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        return torch.load(f, *args, **{**kwargs, "mmap": True})


@contextmanager
def _mapped_fragments(optimizer: Any, reads: UniversalReads) -> Iterator[None]:
    params = [p for name in FRAGMENT_GROUPS for group in getattr(optimizer, name, None) or [] for p in group]
    loaders = {p: vars(p)["load_hp_checkpoint_state"] for p in params if "load_hp_checkpoint_state" in vars(p)}
    for param, load in loaders.items():
        param.load_hp_checkpoint_state = _counted(load, param, reads)
    universal_checkpoint.torch = _MappingTorch()  # the name DeepSpeed's loader calls; nothing else there reads files
    try:
        yield
    finally:
        universal_checkpoint.torch = torch
        for param, load in loaders.items():
            param.load_hp_checkpoint_state = load


def _counted(load: Callable[..., Any], param: Any, reads: UniversalReads) -> Callable[..., Any]:
    def load_and_count(*args: Any, **kwargs: Any) -> Any:
        step = load(*args, **kwargs)
        mapping = param._hp_mapping  # the fragment it copied, and the optimizer states it cloned
        copied = [mapping.get_hp_fragment(), *mapping.optim_fragment.values()]
        reads.bytes_copied += sum(tensor.numel() * tensor.element_size() for tensor in copied)
        reads.files_mapped += len(copied)
        return step

    return load_and_count
