"""What one rank reads of a merged universal-format file, and how long it takes: its own part (lightning_hpz's ZeRO-3
loader) against DeepSpeed's whole-file ``load_hp_checkpoint_state``, from a cold page cache.

    PYTHONPATH=$PWD python benchmarks/universal_part_reads.py --folder /tmp/parts --mib 256 --ranks 4 16 64

Writes one fp32 file of ``--mib`` MiB into ``--folder`` (a disk file system: tmpfs keeps every page), then for each N
of ``--ranks`` loads part 1 of N both ways. Bytes read are the process's ``read_bytes`` (``/proc/self/io``: what the
storage delivered, read-ahead included); the page cache is emptied before each load (``fsync`` and
``POSIX_FADV_DONTNEED``). One process, no process group: the rank and size come from a stand-in group.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from pathlib import Path
from types import SimpleNamespace

import deepspeed.comm
import torch
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

from lightning_hpz.partitioning.universal_load import UniversalReads, _stage3_own_part


def _read_bytes() -> int:
    with open("/proc/self/io") as counters:
        return int(next(line for line in counters if line.startswith("read_bytes")).split()[1])


def _evict(path: Path) -> None:
    gc.collect()  # a tensor still mapping the file keeps its pages
    with open(path, "rb") as stream:
        os.fsync(stream.fileno())
        os.posix_fadvise(stream.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _measure(load, optimizer, folder: Path) -> tuple[float, float]:
    """MiB read from storage and seconds for one load of part ``optimizer``'s rank."""
    _evict(folder / "fp32.pt")
    before, started = _read_bytes(), time.perf_counter()
    part = load(optimizer, str(folder), "fp32", param=None).clone()
    seconds = time.perf_counter() - started
    del part
    return (_read_bytes() - before) / 2**20, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, required=True)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 16, 64])
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    torch.save(torch.randn(args.mib * 2**18), args.folder / "fp32.pt")
    deepspeed.comm.get_rank = lambda group=None: group.rank
    deepspeed.comm.get_world_size = lambda group=None: group.size
    loaders = {
        "own part": _stage3_own_part(UniversalReads()),
        "DeepSpeed": DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state,
    }
    for size in args.ranks:
        group = SimpleNamespace(rank=1, size=size)
        optimizer = SimpleNamespace(dp_process_group=group, _get_param_partition_group=lambda param, group=group: group)
        for name, load in loaders.items():
            mib, seconds = _measure(load, optimizer, args.folder)
            print(f"N={size:4d}  {name:9s}  read {mib:8.2f} MiB  in {seconds:.3f} s  (part {args.mib / size:.2f} MiB)")
    (args.folder / "fp32.pt").unlink()


if __name__ == "__main__":
    main()
