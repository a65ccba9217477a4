"""A job that saves ``last.ckpt`` after every step, to be killed whole during its saves (tests/test_killed_saves.py).

Run as ``python killed_saves.py '<json options>'`` in a process group of its own (the test forks both ranks from the
warm launcher, as torchrun starts them; Lightning's launcher would start rank 1 in the same group), and a SIGKILL of
the process group (the test's, or the fault point's with ``LIGHTNING_HPZ_FAULT_SCOPE=job``) ends both, as a
scheduler ends a job. Rank 0 appends to ``progress.txt`` the step of each checkpoint a save has reported committed
(when the next step starts, the save of the previous one has returned), and writes ``start<launch>.json`` with the
step the launch resumed from, its process group (what the test kills) and, at the end, the step it reached.
"""

import json
import os
import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader
from toy_training import RegressionData, ToyRegressor

import lightning_hpz


class CommitLog(L.Callback):
    def __init__(self, out: Path, launch: int) -> None:
        self.out, self.launch = out, launch
        self.record: dict = {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.record.update(start_step=trainer.global_step, process_group=os.getpgid(0))
        self._write(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == 0 and trainer.global_step > self.record["start_step"]:
            with open(self.out / "progress.txt", "a") as progress:  # the previous step's save has returned
                progress.write(f"{trainer.global_step}\n")
                progress.flush()
                os.fsync(progress.fileno())

    def on_train_end(self, trainer, pl_module) -> None:
        self.record["end_step"] = trainer.global_step
        self._write(trainer)

    def _write(self, trainer) -> None:
        if trainer.global_rank == 0:
            (self.out / f"start{self.launch}.json").write_text(json.dumps(self.record))


def main(options: dict) -> None:
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0, verbose=False)
    every_step = ModelCheckpoint(dirpath=out / "ckpts", every_n_train_steps=1, save_top_k=0, save_last=True)
    trainer = L.Trainer(
        strategy=lightning_hpz.HpzStrategy(stage=3), accelerator="cpu", devices=2, max_steps=options["max_steps"],
        logger=False, callbacks=[every_step, CommitLog(out, options["launch"])], enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=out,
    )  # fmt: skip
    resume = "last" if options["launch"] > 0 else None  # as a requeued job resumes
    trainer.fit(ToyRegressor(), DataLoader(RegressionData(size=4096), batch_size=8), ckpt_path=resume)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
