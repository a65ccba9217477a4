"""LitGPT's own pre-training loop (``litgpt.pretrain.main``, unmodified) on a Fabric whose strategy is hpZ or DDP.

Run as ``python litgpt_pretrain.py '<json options>'`` under torchrun (or the test suite's warm launcher). LitGPT
hard-codes FSDP in ``pretrain.setup``, so a user who wants hpZ builds the Fabric and calls ``pretrain.main``, as here:
a tiny GPT config, tokens made up on the spot (each row counts up from a random start, so there is something to
learn), two micro-batches per optimizer step (``no_backward_sync``), clipping, a checkpoint every two steps.
``resume: "auto"`` continues from the newest checkpoint in ``out`` (LitGPT's own resume); ``initial_checkpoint``
starts from a plain ``lit_model.pth`` that rank 0 writes first (LitGPT's ``initial_checkpoint_dir``, loaded with
``fabric.load_raw``). Each rank writes ``rank<r>.json``: the losses LitGPT logged and DeepSpeed's step count.
"""

import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # LitGPT calls torch.compile; CPU tests do not need it compiled

import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.loggers import Logger
from litgpt import pretrain
from litgpt.args import EvalArgs, TrainArgs
from litgpt.config import Config
from litgpt.data import DataModule
from litgpt.model import GPT
from torch.utils.data import DataLoader

import lightning_hpz

WORLD = 4
MICRO_BATCH = 2
VOCAB = 64
CONFIG = Config(name="tiny", n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=VOCAB, padded_vocab_size=VOCAB)


class CountingTokens(DataModule):
    """Rows of ``block_size + 1`` tokens, each counting up (mod the vocabulary) from a random start."""

    def connect(self, tokenizer=None, batch_size: int = 1, max_seq_length=None, **kwargs) -> None:
        self.batch_size, self.length = batch_size, max_seq_length + 1

    def setup(self, stage: str = "") -> None:
        starts = torch.randint(0, VOCAB, (256, 1), generator=torch.Generator().manual_seed(7))
        self.rows = (starts + torch.arange(self.length)) % VOCAB

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.rows, batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.rows[:16], batch_size=self.batch_size)


class LoggedLosses(Logger):
    """Keeps what LitGPT logs through ``fabric.log_dict``."""

    def __init__(self) -> None:
        self.records: list[dict] = []

    @property
    def name(self) -> str:
        return "recorded"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict, step=None) -> None:
        self.records.append({key: float(value) for key, value in metrics.items() if key in ("loss", "iter", "step")})

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


def build_strategy(options: dict):
    if options["strategy"] == "ddp":
        return "ddp"
    return lightning_hpz.HpzFabricStrategy(stage=3, hpz_partition_size=options["hpz"])


def finish(fabric: L.Fabric, logger: LoggedLosses, out: Path) -> None:
    """Write this rank's record (what LitGPT logged, DeepSpeed's step count) and tear the strategy down."""
    record = {"logged": logger.records}
    if isinstance(fabric.strategy, lightning_hpz.HpzFabricStrategy):
        record["global_steps"] = fabric.strategy.model.global_steps
        fabric.strategy.teardown()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(record))


def write_initial_checkpoint(fabric: L.Fabric, folder: Path) -> Path:
    """A whole model's state dict, as LitGPT's ``lit_model.pth`` holds it (made once, by rank 0, on the CPU)."""
    if fabric.global_rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(3)
        torch.save(GPT(CONFIG).state_dict(), folder / "lit_model.pth")
    fabric.barrier()
    return folder


def main(options: dict) -> None:
    world = options.get("devices", WORLD)  # 4 CPU processes in the suite; 1 on a GPU (gpu_acceptance.py)
    logger = LoggedLosses()
    fabric = L.Fabric(
        strategy=build_strategy(options),
        accelerator=options.get("accelerator", "cpu"),
        devices=world,
        loggers=[logger],
    )
    fabric.launch()
    iterations = options["iterations"]
    train = TrainArgs(
        save_interval=2,
        log_interval=1,
        global_batch_size=2 * MICRO_BATCH * world,  # two micro-batches per optimizer step
        micro_batch_size=MICRO_BATCH,
        max_tokens=iterations * MICRO_BATCH * CONFIG.block_size * world,
        max_norm=1.0,
        lr_warmup_steps=1,
        min_lr=1e-4,
    )
    out = Path(options["out"])
    initial = write_initial_checkpoint(fabric, out / "initial") if options.get("initial_checkpoint") else None
    pretrain.main(
        fabric, devices=world, seed=42, initial_checkpoint_dir=initial, resume=options.get("resume", False),
        config=CONFIG, data=CountingTokens(), out_dir=out / "litgpt", tokenizer_dir=None, tokenizer=None,
        train=train, eval=EvalArgs(interval=1000, max_iters=2), optimizer={"class_path": "torch.optim.AdamW",
        "init_args": {"lr": 3e-3}}, num_nodes=1,
    )  # fmt: skip
    finish(fabric, logger, out)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
