"""LitGPT's own full fine-tuning loop (``litgpt.finetune.full.main``, unmodified) on a Fabric with hpZ or DDP.

Run as ``python litgpt_finetune.py '<json options>'`` under torchrun (or the test suite's warm launcher). Rank 0 first
makes what LitGPT reads from a checkpoint folder: a tiny GPT's ``lit_model.pth`` and ``model_config.yaml``, a
character-level tokenizer, and a small instruction data set. ``full.main`` then loads the weights into the set-up
model (``model.load_state_dict`` after ``fabric.setup``), trains two micro-batches per step, saves every two steps,
and, with ``resume: "auto"``, continues from the newest ``step-*`` checkpoint. Each rank writes ``rank<r>.json``: the
losses LitGPT logged (by step) and DeepSpeed's step count.
"""

import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import json
import string
import sys
from pathlib import Path

import lightning as L
import torch
from litgpt.args import EvalArgs, TrainArgs
from litgpt.config import Config
from litgpt.data import JSON
from litgpt.finetune import full
from litgpt.model import GPT
from litgpt.utils import save_config
from litgpt_pretrain import LoggedLosses, build_strategy, finish
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

WORLD = 4
MICRO_BATCH = 2
CONFIG = Config(name="tiny", n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=64, padded_vocab_size=64)
WORDS = ["abc", "hello", "xyz", "cat dog", "a b c", "tiny", "model", "zero", "shard", "node", "link", "rank"]


def write_checkpoint_folder(folder: Path) -> None:
    """What ``full.main`` reads: weights, model config, a tokenizer LitGPT accepts."""
    folder.mkdir(parents=True, exist_ok=True)
    vocabulary = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocabulary.update({char: index + 3 for index, char in enumerate(string.ascii_lowercase + " .,:#\n")})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(folder / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    (folder / "tokenizer_config.json").write_text(json.dumps({**settings, "add_bos_token": False}))
    save_config(CONFIG, folder)
    torch.manual_seed(5)
    torch.save(GPT(CONFIG).state_dict(), folder / "lit_model.pth")


def write_data(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"instruction": f"say {word}", "input": "", "output": word} for word in WORDS]
    (folder / "train.json").write_text(json.dumps(rows * 4))
    (folder / "val.json").write_text(json.dumps(rows[:4]))


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
    out = Path(options["out"])
    checkpoint, data = out.parent / "checkpoint", out.parent / "data"
    if fabric.global_rank == 0 and not (checkpoint / "lit_model.pth").exists():
        write_checkpoint_folder(checkpoint)
        write_data(data)
    fabric.barrier()
    train = TrainArgs(
        save_interval=2,
        log_interval=1,
        global_batch_size=2 * MICRO_BATCH * world,
        micro_batch_size=MICRO_BATCH,
        lr_warmup_steps=1,
        epochs=5,
        max_steps=options["steps"],
        max_seq_length=CONFIG.block_size,
    )
    evaluation = EvalArgs(interval=1000, max_new_tokens=1000, max_iters=2)  # no generation: prompts + 1000 > 64
    optimizer = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 3e-3}}
    full.main(
        fabric, world, options.get("resume", False), 1337, CONFIG, JSON(json_path=data, num_workers=0), checkpoint,
        out / "litgpt", train, evaluation, optimizer, 1,
    )  # fmt: skip
    finish(fabric, logger, out)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
