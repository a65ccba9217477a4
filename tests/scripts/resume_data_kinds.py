"""Resume from training data that is not one map-style DataLoader read in order, under HpzStrategy (ZeRO 2).

Run as ``python resume_data_kinds.py '<json options>'`` (one process per rank). Each entry of ``options["cases"]`` is
a training run in the same processes, from scratch with a checkpoint every ``checkpoint_step`` steps, or (with
``resume_from``) resumed from one of those checkpoints to ``steps``:

- ``iterable``: an ``IterableDataset`` that yields this rank's share of a seeded stream (no position to resume at:
  resumed with ``exact_resume=False``, it is read again up to the position; ``exact_resume: true`` is refused when
  the fit starts, fresh or resumed);
- ``stateful``: a ``Stateful`` ``IterableDataset`` whose position (the next example of the corpus it reads) differs
  between ranks, checkpointed mid-epoch by ``ModelCheckpoint``;
- ``stateful_preempted``: the same, checkpointed by a preemption (every rank signals itself SIGTERM after
  ``preempt_step``; ``PreemptionCheckpoint`` saves at a later step and the fit exits with code 75);
- ``two_loaders``: two training DataLoaders, the second a third as long (Lightning restarts it when it runs out);
- ``shuffled_workers``: a shuffled DataLoader (Lightning's distributed sampler) read by 2 worker processes.

Each rank writes ``rank<r>.json``: per case (``name``, default its kind), the loss of every batch trained and the ids
of its examples (streams), keyed by ``epoch:batch_idx``; how a preempted fit ended (its step and checkpoint); the
error that refused a resume.
"""

import json
import os
import signal
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import lightning_hpz
from lightning_hpz.exact_resume.data_order import DataOrderError
from lightning_hpz.lifecycle.run_exit import TrainingPreempted

FEATURES = 8


def examples(count: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(count, FEATURES, generator=generator)
    return TensorDataset(x, x.sin().sum(dim=1, keepdim=True))


class RankStream(IterableDataset):
    """A seeded stream of examples, each rank taking every ``world``-th; the same sequence at every pass."""

    def __init__(self, count: int) -> None:
        self.data = examples(count, seed=11)

    def __iter__(self):
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        for index in range(rank, len(self.data), world):
            yield self.data[index]


class PositionedRankStream(IterableDataset):
    """Rank r's examples r, r + world, ... of a seeded corpus, with their ids; Stateful: its position is the id of the
    next example, so it differs between ranks, and a rank given another's position would read the other's examples."""

    def __init__(self, count: int) -> None:
        self.data = examples(count, seed=15)
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self.next_id, self._start = self.rank, self.rank

    def __iter__(self):
        start, self._start = self._start, self.rank  # a pass after this one starts from the beginning
        for index in range(start, len(self.data), self.world):
            self.next_id = index + self.world
            yield (*self.data[index], index)

    def state_dict(self) -> dict:
        return {"next_id": self.next_id}

    def load_state_dict(self, state: dict) -> None:
        self._start = int(state["next_id"])


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        pairs = batch if isinstance(batch, list) and isinstance(batch[0], list) else [batch]  # one per loader
        return sum((self.net(x) - y).pow(2).mean() for x, y, *_ids in pairs)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def train_data(kind: str):
    if kind == "iterable":
        return DataLoader(RankStream(64), batch_size=4)
    if kind in ("stateful", "stateful_preempted"):
        return DataLoader(PositionedRankStream(64), batch_size=4)
    if kind == "two_loaders":
        return [DataLoader(examples(64, seed=12), batch_size=4), DataLoader(examples(24, seed=13), batch_size=4)]
    if kind == "shuffled_workers":
        return DataLoader(examples(64, seed=14), batch_size=4, shuffle=True, num_workers=2)
    raise ValueError(kind)


class BatchRecorder(L.Callback):
    def __init__(self) -> None:
        self.record: dict[str, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        ids = batch[2].tolist() if isinstance(batch, list) and len(batch) == 3 else None
        self.record[f"{trainer.current_epoch}:{batch_idx}"] = {"loss": float(outputs["loss"]), "ids": ids}


class SignalAfterStep(L.Callback):
    """Every rank sends itself SIGTERM once ``step`` optimizer steps are done, as a scheduler preempting the job."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def run_case(case: dict, options: dict, out: Path) -> dict:
    L.seed_everything(0, verbose=False)
    recorder = BatchRecorder()
    resuming = case.get("resume_from") is not None
    callbacks = [recorder]
    if not resuming and "preempt_step" in case:
        callbacks.append(SignalAfterStep(case["preempt_step"]))
    elif not resuming:
        every = case["checkpoint_step"]
        callbacks.append(ModelCheckpoint(dirpath=out / case["name"], every_n_train_steps=every, save_top_k=-1))
    trainer = L.Trainer(
        strategy=lightning_hpz.HpzStrategy(stage=2, exact_resume=case.get("exact_resume", True)),
        accelerator="cpu",
        devices=options["devices"],
        max_steps=case["steps"],
        callbacks=callbacks,
        default_root_dir=str(out / case["name"]),
        logger=False,
        enable_checkpointing=not resuming and "preempt_step" not in case,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    outcome: dict = {"batches": recorder.record}
    try:
        trainer.fit(Regressor(), train_data(case["kind"]), ckpt_path=case.get("resume_from"))
    except TrainingPreempted as preempted:
        outcome.update(preempted_at=trainer.global_step, checkpoint=preempted.checkpoint)
    except DataOrderError as refused:  # raised on every rank alike; the last case of a launch (groups are aborted)
        outcome["refused"] = str(refused)
    return outcome


def main(options: dict) -> None:
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", 0))
    records = {}
    for case in options["cases"]:
        case.setdefault("name", case["kind"])
        records[case["name"]] = run_case(case, options, out)
    (out / f"rank{rank}.json").write_text(json.dumps({"cases": records}))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
