"""What making a checkpoint durable and verifiable costs per GB, measured side by side in one run.

Three ways to commit the same shards (``torch.save`` of float32 tensors, as DeepSpeed writes them):

* ``hash while writing`` (what the commit does now): DeepSpeed's ``TorchCheckpointEngine`` wrapped by
  ``partitioning/hashed_writes.py``, which feeds every chunk to blake2b on its way to the file, then fsyncs it;
* ``read back`` (the commit before): a plain save, fsync and drop from the page cache, then blake2b read back from the
  storage;
* ``not durable`` (the first commits): a plain save, blake2b from the page cache, no fsync.

    python benchmarks/checkpoint_durability.py [--gib 1] [--files 8] [--dir DIR] [--rounds 3]

DIR: where to write (default: a temporary folder; pass one on the file system your checkpoints use). Prints seconds
per GB of each step (medians of the rounds) and each commit's ratio to the one that is not durable; asserts nothing.
Run it with nothing else running on the machine.
"""

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from lightning_hpz import durability
from lightning_hpz.checkpointing import manifest
from lightning_hpz.partitioning import hashing_writes


def shards(count: int, size: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [{"shard": torch.randn(size // 4, generator=generator)} for _ in range(count)]


def timed(timings: dict[str, float], name: str, work) -> None:
    start = time.perf_counter()
    work()
    timings[name] = time.perf_counter() - start


def plain_commit(folder: Path, states: list[dict], timings: dict[str, float]) -> None:
    paths = [folder / f"plain_{index}.pt" for index in range(len(states))]
    timed(timings, "torch.save", lambda: [torch.save(s, p) for s, p in zip(states, paths, strict=True)])
    timed(timings, "checksum from page cache", lambda: [manifest.file_digest(p) for p in paths])
    timed(timings, "fsync + drop from cache", lambda: [durability.persist_file(p) for p in paths])
    timed(timings, "checksum read back", lambda: [manifest.file_digest(p) for p in paths])


def hashed_commit(folder: Path, states: list[dict], timings: dict[str, float]) -> None:
    inner = TorchCheckpointEngine()
    inner.zipfile_serialization = True  # DeepSpeed's default under a checkpoint config
    engine = SimpleNamespace(checkpoint_engine=inner)

    def save_all() -> None:
        with hashing_writes(engine, folder) as writes:
            for index, state in enumerate(states):
                engine.checkpoint_engine.save(state, str(folder / f"hashed_{index}.pt"))
        assert len(writes.digests) == len(states)

    timed(timings, "torch.save hashing + fsync", save_all)


def one_round(folder: Path, states: list[dict]) -> dict[str, float]:
    folder.mkdir()
    timings: dict[str, float] = {}
    plain_commit(folder, states, timings)
    hashed_commit(folder, states, timings)
    shutil.rmtree(folder)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    total = int(args.gib * (1 << 30))
    states = shards(args.files, total // args.files)
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        rounds = [one_round(Path(scratch) / f"round{r}", states) for r in range(args.rounds)]
    gigabytes = total / 1e9
    median = {name: statistics.median(r[name] for r in rounds) / gigabytes for name in rounds[0]}
    print(f"{args.gib} GiB in {args.files} files, {args.rounds} rounds, under {args.dir or tempfile.gettempdir()}")
    for name, seconds in median.items():
        print(f"  {name:<28} {seconds:6.2f} s/GB")
    not_durable = median["torch.save"] + median["checksum from page cache"]
    read_back = median["torch.save"] + median["fsync + drop from cache"] + median["checksum read back"]
    hashed = median["torch.save hashing + fsync"]
    print(f"  not durable (save + checksum from cache):   {not_durable:6.2f} s/GB")
    print(f"  read back (save + fsync + checksum read):   {read_back:6.2f} s/GB ({read_back / not_durable:.2f}x)")
    print(f"  hash while writing (save through the hash): {hashed:6.2f} s/GB ({hashed / not_durable:.2f}x)")


if __name__ == "__main__":
    main()
