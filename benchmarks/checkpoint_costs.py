"""What the trustworthy checkpoints cost: blake2b seconds per GB, and the universal conversion of a checkpoint.

    python benchmarks/checkpoint_costs.py CKPT_DIR [--synthetic-gib 1]

CKPT_DIR: a checkpoint written by HpzStrategy (e.g. the quickstart's, `lightning-hpz fit --config
configs/quickstart.yaml --trainer.max_steps 2 --trainer.val_check_interval 2`). Prints timings; asserts nothing.
"""

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from lightning_hpz.checkpointing import manifest
from lightning_hpz.checkpointing.universal import convert_to_universal


def seconds_per_gb(paths: list[Path]) -> tuple[str, int]:
    """Wall and CPU seconds per GB: on a shared machine the CPU time is the cost, the wall time the contention."""
    size = sum(p.stat().st_size for p in paths)
    wall, cpu = time.perf_counter(), time.process_time()
    for path in paths:
        manifest.file_digest(path)
    wall, cpu = (time.perf_counter() - wall) / (size / 1e9), (time.process_time() - cpu) / (size / 1e9)
    rate = f"{wall:.2f} s/GB wall, {cpu:.2f} s/GB CPU"
    return rate, size


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint_dir", type=Path)
    parser.add_argument("--synthetic-gib", type=float, default=1.0)
    args = parser.parse_args()
    files = [args.checkpoint_dir / name for name in manifest.checkpoint_files(args.checkpoint_dir)]
    rate, size = seconds_per_gb(files)
    print(f"checkpoint files: {size / 1e6:.1f} MB, blake2b {rate}")
    with tempfile.TemporaryDirectory() as scratch:
        synthetic = Path(scratch) / "synthetic.bin"
        with open(synthetic, "wb") as stream:
            for _ in range(int(args.synthetic_gib * 1024)):
                stream.write(os.urandom(1 << 20))
        rate, size = seconds_per_gb([synthetic])
        print(f"synthetic file: {size / 1e9:.2f} GB, blake2b {rate} (page cache warm, one core)")
        target = Path(scratch) / "universal"
        wall, cpu = time.perf_counter(), time.process_time()
        convert_to_universal(args.checkpoint_dir, target)
        converted = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
        spent = f"{time.perf_counter() - wall:.1f} s wall, {time.process_time() - cpu:.1f} s CPU"
        print(f"universal conversion: {spent}, {converted / 1e6:.1f} MB written")
        shutil.rmtree(target)


if __name__ == "__main__":
    main()
