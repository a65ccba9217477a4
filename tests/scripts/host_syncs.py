"""Count the blocking host synchronizations lightning_hpz itself issues in each training batch, on CPU processes.

Run as ``python host_syncs.py '<json options>'``. What would stall a GPU pipeline is counted when this package's own
code asks for it: a value read from a tensor (``item``, ``tolist``, ``bool``/``int``/``float``), and every collective
of :mod:`lightning_hpz.collectives` that hands a result to the host (``all_reduce_values``, the gathers, the object
broadcast). ``collectives.all_reduce`` is not counted: it returns a device tensor, and under NCCL it is queued on the
stream without the host waiting; whoever reads its result is counted by the read. The preemption flags
(``collectives.PendingReduction``, read a step after they were reduced) wait for no GPU work of the running step and
are not counted. A sync is the
package's when the innermost frame outside torch that asked for it is in lightning_hpz.
Each rank writes ``rank<r>.json``: per training batch, the syncs and the optimizer steps done after it.
"""

import collections
import functools
import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

import lightning_hpz
from lightning_hpz import collectives
from lightning_hpz.callbacks import LossStabilityMonitor, SecondaryPartitionCheck, TokenThroughputMonitor

sys.path.insert(0, str(Path(__file__).parent))
from callback_training import TINY_ZERO3, PaddedTokens, TinyLanguageModel

PACKAGE = str(Path(lightning_hpz.__file__).parent)
TORCH = str(Path(torch.__file__).parent)
COUNTED_COLLECTIVES = ("all_reduce_values", "all_gather_tensor", "all_gather_object", "broadcast_object")
HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__")


class SyncCounter(L.Callback):
    """First in the callback list: each sync is charged to the training batch that is running."""

    def __init__(self) -> None:
        self.batch = None
        self.syncs: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        self.steps_after: dict[int, int] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batch = batch_idx

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps_after[batch_idx] = trainer.global_step

    def on_validation_start(self, trainer, pl_module):
        self.batch = None

    def charge(self, what: str) -> None:
        if self.batch is not None:
            self.syncs[self.batch][what] += 1


def asked_by_package() -> bool:
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(TORCH):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(PACKAGE)


def count_host_reads(counter: SyncCounter) -> None:
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            if asked_by_package() and not sys._getframe(1).f_code.co_filename.endswith("collectives.py"):
                counter.charge(f"Tensor.{_name}")
            return _original(self, *args, **kwargs)

        setattr(torch.Tensor, name, counted)


def count_collectives(counter: SyncCounter) -> None:
    for name in COUNTED_COLLECTIVES:
        original = getattr(collectives, name)

        @functools.wraps(original)
        def counted(*args, _original=original, _name=name, **kwargs):
            counter.charge(f"collectives.{_name}")
            return _original(*args, **kwargs)

        setattr(collectives, name, counted)


def main(options: dict) -> None:
    out = Path(options["out"])
    L.seed_everything(0, verbose=False)
    counter = SyncCounter()
    callbacks = [counter, TokenThroughputMonitor(window_size=2), SecondaryPartitionCheck(every_n_steps=1000)]
    if options.get("loss_monitor"):
        callbacks.append(LossStabilityMonitor(warmup=2, dirpath=str(out / "stability")))
    trainer = L.Trainer(
        strategy=lightning_hpz.HpzStrategy(stage=3, hpz_partition_size=2, config=TINY_ZERO3),
        accelerator="cpu",
        devices=2,
        max_steps=options["steps"],
        accumulate_grad_batches=options["accumulate"],
        log_every_n_steps=options["log_every"],
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    count_host_reads(counter)
    count_collectives(counter)
    trainer.fit(TinyLanguageModel(), DataLoader(PaddedTokens(), batch_size=4))
    check = next(c for c in trainer.callbacks if isinstance(c, SecondaryPartitionCheck))
    record = {
        "syncs": {str(batch): dict(counts) for batch, counts in counter.syncs.items()},
        "steps_after": counter.steps_after,
        "secondary_checks": check.checks_run,
        "preemption_callback": [type(c).__name__ for c in trainer.callbacks if "Preemption" in type(c).__name__],
        "losses_judged": sum(len(c.losses) for c in trainer.callbacks if isinstance(c, LossStabilityMonitor)),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
