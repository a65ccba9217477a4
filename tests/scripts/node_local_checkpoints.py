"""Two ranks whose checkpoint folders are not one folder, as on two nodes with node-local disks, on one machine.

Run as ``python node_local_checkpoints.py '<json options>'`` under torchrun (or the suite's warm launcher). Rank 1 first
moves into a mount namespace of its own and mounts an empty tmpfs over ``options["ckpt_parent"]``: it sees another
folder at the same path, as a second node with its own disk would. Then both train with a ModelCheckpoint under that
path. Each rank writes ``rank<r>.json``: the error its first save raised, and whether a checkpoint appeared.
"""

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_hpz

CLONE_NEWNS = 0x00020000


def own_disk(folder: Path) -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(folder)], check=True)


def main(options: dict) -> None:
    parent = Path(options["ckpt_parent"])
    rank = int(os.environ["RANK"])
    if rank == 1:
        own_disk(parent)
    saving = ModelCheckpoint(dirpath=parent / "ckpts", every_n_train_steps=2, save_top_k=-1)
    trainer = L.Trainer(
        strategy=lightning_hpz.HpzStrategy(stage=2), accelerator="cpu", devices=2, max_steps=4, logger=False,
        callbacks=[saving], enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    record = {"error": None}
    try:
        trainer.fit(BoringModel())
    except lightning_hpz.checkpointing.CheckpointStorageError as error:
        record["error"] = str(error)
    record["checkpoints"] = sorted(path.name for path in (parent / "ckpts").glob("*.ckpt"))
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
