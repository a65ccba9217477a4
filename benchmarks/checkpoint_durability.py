"""What making a checkpoint durable costs per GB, measured side by side in one run: writing its files, fsync (and
dropping them from the page cache), and the blake2b checksum read back from the storage, against the checksum read
from memory as commits did before.

    python benchmarks/checkpoint_durability.py [--gib 1] [--files 8] [--dir DIR] [--rounds 3]

DIR: where to write (default: a temporary folder; pass one on the file system your checkpoints use). Prints seconds
per GB (medians of the rounds) and the ratio of a durable commit to the old one; asserts nothing. Run it with nothing
else running on the machine.
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from lightning_hpz import durability
from lightning_hpz.checkpointing import manifest

CHUNK = 64 << 20


def write_files(folder: Path, count: int, size: int) -> list[Path]:
    paths = []
    block = os.urandom(CHUNK)
    for index in range(count):
        path = folder / f"shard_{index}.pt"
        with open(path, "wb") as stream:
            for _ in range(max(size // CHUNK, 1)):
                stream.write(block)
        paths.append(path)
    return paths


def one_round(folder: Path, count: int, size: int) -> dict[str, float]:
    folder.mkdir()
    timings = {}
    start = time.perf_counter()
    paths = write_files(folder, count, size)
    timings["write"] = time.perf_counter() - start
    start = time.perf_counter()
    for path in paths:
        manifest.file_digest(path)  # what a commit checksummed before: the bytes still in memory
    timings["checksum from page cache"] = time.perf_counter() - start
    start = time.perf_counter()
    for path in paths:
        durability.persist_file(path)
    durability.persist_tree_directories(folder)
    timings["fsync + drop from cache"] = time.perf_counter() - start
    start = time.perf_counter()
    for path in paths:
        manifest.file_digest(path)  # now read back from the storage
    timings["checksum from storage"] = time.perf_counter() - start
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
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        rounds = [one_round(Path(scratch) / f"round{r}", args.files, total // args.files) for r in range(args.rounds)]
    gigabytes = total / 1e9
    median = {name: statistics.median(r[name] for r in rounds) / gigabytes for name in rounds[0]}
    print(f"{args.gib} GiB in {args.files} files, {args.rounds} rounds, under {args.dir or tempfile.gettempdir()}")
    for name, seconds in median.items():
        print(f"  {name:<26} {seconds:6.2f} s/GB")
    before = median["write"] + median["checksum from page cache"]
    after = median["write"] + median["fsync + drop from cache"] + median["checksum from storage"]
    print(f"  durable commit / old commit: {after / before:.2f} ({after:.2f} vs {before:.2f} s/GB)")


if __name__ == "__main__":
    main()
