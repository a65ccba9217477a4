"""What ``fit``, ``validate`` and ``test`` say when ``ckpt_path`` is not a DeepSpeed checkpoint, on real processes.

Run under torchrun with one rank: after a failure on several ranks the strategy aborts the process groups, so one
process could make one attempt only. Trains 2 steps and saves a real checkpoint, then hands each entry point four
wrong paths: one that does not exist, an empty folder, the checkpoint's ``checkpoint`` subfolder and a file inside
it. Writes ``rank0.json``: for each attempt, the exception's type and message.
"""

import json
import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_hpz


def trainer(out: Path, stage: int) -> L.Trainer:
    return L.Trainer(
        strategy=lightning_hpz.HpzStrategy(stage=stage),
        accelerator="cpu",
        devices=1,
        max_steps=2,
        limit_val_batches=1,
        limit_test_batches=1,
        default_root_dir=out,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def attempt(call) -> dict:
    try:
        call()
    except Exception as err:
        return {"type": type(err).__name__, "message": str(err)}
    return {"type": None, "message": ""}


def main(options: dict) -> None:
    out = Path(options["out"])
    first = trainer(out, options["stage"])
    first.fit(BoringModel())
    checkpoint = out / "real.ckpt"
    first.save_checkpoint(checkpoint)
    (out / "empty").mkdir(exist_ok=True)
    inside = sorted((checkpoint / "checkpoint").iterdir())[0]
    wrong = {"missing": out / "missing", "empty": out / "empty", "subfolder": checkpoint / "checkpoint", "file": inside}
    record = {}
    for entry in ("fit", "validate", "test"):
        for name, path in wrong.items():
            run = getattr(trainer(out, options["stage"]), entry)
            record[f"{entry}/{name}"] = attempt(lambda run=run, path=path: run(BoringModel(), ckpt_path=str(path)))
    record["checkpoint"] = str(checkpoint)
    (out / f"rank{first.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
