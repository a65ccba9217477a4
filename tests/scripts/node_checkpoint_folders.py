"""One node of a two-node job whose checkpoints go first to a folder both nodes share, then to a folder each node has
for itself at the same path (as node-local disks are).

Run as ``python node_checkpoint_folders.py '<json options>'`` once per node, with ``NODE_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` set (Lightning's launcher starts the node's other ranks); ``options["local"]`` must already be this
node's own folder (the test bind-mounts one per node over that path). Three fits under ZeRO-3, in one process so that
the job starts once:

1. ``ModelCheckpoint`` into ``options["shared"]``: ``last.ckpt`` at step 2;
2. a new Trainer, ``fit(ckpt_path="last")`` there: resumes at step 2, saves ``last.ckpt`` at step 4;
3. ``ModelCheckpoint`` into ``options["local"]``: its first save, at step 2, must be refused on every rank.

Each rank writes ``rank<r>.json`` into ``out`` (shared by the nodes): the step each fit started and ended at, the path
the resume loaded, and the refusal (message, step, wall-clock time of the save and of the error: the test compares
them with the processes' exits). The refusal is then re-raised, so that the node ends as a user's job would.
"""

import json
import sys
import time
from pathlib import Path
from typing import Optional

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader
from toy_training import RegressionData, ToyRegressor

import lightning_hpz
from lightning_hpz.checkpointing import CheckpointStorageError

SAVE_EVERY = 2


class Record(L.Callback):
    """The step a fit started at, and the step and wall-clock time of its first save (Lightning runs checkpoint
    callbacks after the others, so this batch-end hook comes just before ``ModelCheckpoint``'s save)."""

    def __init__(self) -> None:
        self.started_at: Optional[int] = None
        self.first_save: Optional[tuple[int, float]] = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.started_at = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.first_save is None and trainer.global_step % SAVE_EVERY == 0:
            self.first_save = (trainer.global_step, time.time())


def fit(folder: Path, max_steps: int, record: Record, ckpt_path: Optional[str] = None) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    saving = ModelCheckpoint(dirpath=folder, every_n_train_steps=SAVE_EVERY, save_top_k=0, save_last=True)
    trainer = L.Trainer(
        strategy=lightning_hpz.HpzStrategy(stage=3), accelerator="cpu", devices=1, num_nodes=2, max_steps=max_steps,
        callbacks=[record, saving], default_root_dir=folder, logger=False, num_sanity_val_steps=0,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(ToyRegressor(), DataLoader(RegressionData(), batch_size=8), ckpt_path=ckpt_path)
    return trainer


def main(options: dict) -> None:
    out, shared, local = Path(options["out"]), Path(options["shared"]), Path(options["local"])
    first, second, third = Record(), Record(), Record()
    trainer = fit(shared, SAVE_EVERY, first)
    resumed = fit(shared, 2 * SAVE_EVERY, second, ckpt_path="last")
    record = {
        "rank": trainer.global_rank,
        "shared": {
            "first": [first.started_at, trainer.global_step],
            "resumed": [second.started_at, resumed.global_step],
            "resumed_from": str(resumed.ckpt_path),
        },
        "local": {"error": None},
    }
    try:
        fit(local, 2 * SAVE_EVERY, third)
    except CheckpointStorageError as error:
        record["local"] = {"error": str(error), "raised_at": time.time()}
        raise
    finally:
        record["local"]["first_save"] = third.first_save
        (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
