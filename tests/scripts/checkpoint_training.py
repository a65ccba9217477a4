"""Checkpoints written, damaged, moved and resumed by a plain MLP under HpzStrategy (one process per rank).

Run as ``python checkpoint_training.py '<json options>'``. ``options["jobs"]``: fits run one after the other in the
same processes, each ``{"stage", "hpz", "max_steps", "ckpt_path", "ckpt_dir", "kill_rank", "kill_step"}``.
Every 2 steps ``ModelCheckpoint`` saves (``save_last=True``) into the job's ``ckpt_dir`` (default
``options["ckpt_dir"]``). ``kill_rank`` dies half-way through writing its optimizer shard of the checkpoint at
``kill_step``. Each rank writes ``rank<r>.json``: per job the step it resumed at, the losses, or the error it raised;
rank 0 also saves the full fp32 weights it resumed with, and, for a job with ``"moments": true``, Adam's full
moments (every rank's shards joined) at the start and before each save (``moments_job<i>_step<s>.pt``). A job with
``"trace_files": true`` runs under ``strace -f -e trace=%file`` attached to each rank's own process
(``strace_job<i>_rank<r>.txt``); the rank stats ``TRAIN_START_MARKER`` at ``on_train_start``, so the lines before it
are the set-up and the checkpoint load, those after it the training and the saves. Each job records what rank 0
dealt this rank of a manifest (``"dealt"``: per scatter, the file names and the pickled bytes received).
"""

import contextlib
import json
import os
import pickle
import subprocess
import sys
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from optimizer_moments import whole_moments
from torch.utils.data import DataLoader
from toy_training import RegressionData, ToyRegressor

import lightning_hpz
from lightning_hpz import collectives

TRAIN_START_MARKER = "/hpz-trace-marker-train-start"


class TwoGroupRegressor(ToyRegressor):
    """Decay on the weight matrices only, as LLM recipes do: two parameter groups that a resize must keep apart (the
    second also with its own learning rate and betas, so that a group given the first group's settings shows)."""

    def configure_optimizers(self):
        named = list(self.named_parameters())
        decay = [p for name, p in named if p.ndim > 1]
        no_decay = [p for name, p in named if p.ndim <= 1]
        groups = [
            {"params": decay, "weight_decay": 0.1},
            {"params": no_decay, "weight_decay": 0.0, "lr": 1e-3, "betas": (0.8, 0.99)},
        ]
        return torch.optim.AdamW(groups, lr=3e-3)


class ResumeRecorder(L.Callback):
    """Records the step and the full weights a fit starts from, and arms the mid-save kill."""

    def __init__(self, job: dict, out: Path, index: int) -> None:
        self.job, self.out, self.index = job, out, index
        self.record: dict = {}

    def on_train_start(self, trainer, pl_module) -> None:
        import deepspeed

        if self.job.get("trace_files"):
            os.path.exists(TRAIN_START_MARKER)  # a stat in the trace: the load is over, the training begins
        self.record["start_step"] = trainer.global_step
        reads = getattr(trainer.strategy, "universal_reads", None)  # set by a resume on another number of ranks
        self.record["universal_reads"] = reads.as_dict() if reads is not None else None
        groups = trainer.strategy.model.optimizer.param_groups
        self.record["groups"] = [{key: group[key] for key in ("lr", "weight_decay", "betas")} for group in groups]
        params = dict(pl_module.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values()), enabled=self.job.get("stage", 3) == 3):
            weights = {name: p.detach().clone().float() for name, p in params.items()}
        if trainer.global_rank == 0:
            torch.save(weights, self.out / f"weights_job{self.index}.pt")
        self._save_moments(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % 2 == 0:  # ModelCheckpoint (a checkpoint callback: it runs after this) saves now
            self._save_moments(trainer, pl_module)

    def _save_moments(self, trainer, pl_module) -> None:
        """Adam's moments of every parameter, whole (a collective: every rank calls it), kept by rank 0."""
        if not self.job.get("moments") or trainer.global_step == 0:
            return  # before the first step Adam has no moments
        zero_optimizer = trainer.strategy.model.optimizer
        moments = whole_moments(zero_optimizer, pl_module.named_parameters(), self.job.get("stage", 3))
        if trainer.global_rank == 0:
            torch.save(moments, self.out / f"moments_job{self.index}_step{trainer.global_step}.pt")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if trainer.global_step == self.job.get("kill_step") and trainer.global_rank == self.job.get("kill_rank"):
            _die_while_writing_optimizer_shard()


def _die_while_writing_optimizer_shard() -> None:
    original = torch.save

    def half_written_then_killed(obj, f, *args, **kwargs):
        path = getattr(getattr(f, "stream", None), "name", f)  # the file behind the commit's hashing stream
        if "optim_states" not in str(path):
            return original(obj, f, *args, **kwargs)
        original(obj, f, *args, **kwargs)
        if hasattr(f, "flush"):
            f.flush()
        os.truncate(path, os.path.getsize(path) // 2)  # the rest never reached the disk
        os._exit(9)

    torch.save = half_written_then_killed


@contextlib.contextmanager
def file_calls_traced(trace: Path):
    """Every file-related system call of this process (all its threads, and those it starts) into ``trace``."""
    me = os.getpid()
    threads = [arg for tid in os.listdir(f"/proc/{me}/task") for arg in ("-p", tid)]
    log = trace.with_suffix(".log")
    tracer = subprocess.Popen(
        ["strace", "-f", "-e", "trace=%file", "-o", str(trace), *threads],
        stderr=open(log, "w"),  # noqa: SIM115
    )
    deadline = time.monotonic() + 30
    while log.read_text().count("attached") < len(threads) // 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield
    finally:
        tracer.terminate()  # strace detaches and exits
        tracer.wait(timeout=30)


@contextlib.contextmanager
def dealt_recorded(dealt: list):
    """Per scatter, what this rank received: the file names of a manifest's entries and the pickled bytes."""
    scatter = collectives.scatter_object

    def recorded(*args, **kwargs):
        mine = scatter(*args, **kwargs)
        files = (mine.get("result") or {}).get("files") if isinstance(mine, dict) else None
        dealt.append({"files": sorted(files) if isinstance(files, dict) else None, "bytes": len(pickle.dumps(mine))})
        return mine

    collectives.scatter_object = recorded
    try:
        yield
    finally:
        collectives.scatter_object = scatter


def fit(job: dict, options: dict, index: int) -> dict:
    if not job.get("trace_files"):
        return _fit(job, options, index)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    with file_calls_traced(Path(options["out"]) / f"strace_job{index}_rank{rank}.txt"):
        return _fit(job, options, index)


def _fit(job: dict, options: dict, index: int) -> dict:
    L.seed_everything(0, verbose=False)
    out = Path(options["out"])
    recorder = ResumeRecorder(job, out, index)
    strategy = lightning_hpz.HpzStrategy(
        stage=job.get("stage", 3), hpz_partition_size=job.get("hpz", 1), exact_resume=job.get("exact_resume", True)
    )
    checkpoints = ModelCheckpoint(
        dirpath=job.get("ckpt_dir", options.get("ckpt_dir")),
        every_n_train_steps=2,
        save_top_k=-1,
        save_last=True,
        filename="{step}",
    )
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=options["devices"], max_steps=job["max_steps"], logger=False,
        callbacks=[checkpoints, recorder], enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    model = TwoGroupRegressor()
    dealt: list = []
    try:
        with warnings.catch_warnings(record=True) as caught, dealt_recorded(dealt):
            warnings.simplefilter("always")
            trainer.fit(model, DataLoader(RegressionData(), batch_size=8), ckpt_path=job.get("ckpt_path"))
    except lightning_hpz.checkpointing.CheckpointRefusedError as error:
        return {"error": str(error), "error_type": type(error).__name__}
    ours = [str(w.message) for w in caught if "lightning_hpz" in str(w.filename) or "manifest" in str(w.message)]
    record = {**recorder.record, "losses": model.losses, "end_step": trainer.global_step, "warnings": ours}
    return {**record, "dealt": dealt}


def main(options: dict) -> None:
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    records = [fit(job, options, index) for index, job in enumerate(options["jobs"])]
    rank = int(os.environ.get("LOCAL_RANK", 0))  # one node: the local rank is the global rank
    (out / f"rank{rank}.json").write_text(json.dumps({"jobs": records}))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
