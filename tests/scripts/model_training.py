"""lightning_hpz's own models trained under HpzStrategy, launched as a script (one process per rank).

Run as ``python model_training.py '<json options>'``. ``options["jobs"]`` is a list of trainings run one after the
other in the same processes (one hpZ size per script: DeepSpeed's secondary process group is global). Each rank
writes ``rank<r>.json`` into ``out``: per job, the losses, the sample indices it trained on per epoch, how many
parameter elements it held after the model was built, and (for probe jobs) logits before and after training.
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch

import lightning_hpz
from lightning_hpz.data import CausalLMDataModule, SpanCorruptionDataModule
from lightning_hpz.models import T5, Falcon, Llama2
from lightning_hpz.models.sharded_weights import full_element_count, local_element_count

MODELS = {"llama2": Llama2, "falcon": Falcon, "t5": T5}


class Recorder(L.Callback):
    """Collects what the tests assert on, on every rank."""

    def __init__(self, probe: list | None) -> None:
        self.probe = torch.tensor(probe) if probe is not None else None
        self.record: dict = {"losses": [], "samples": {}}

    def on_fit_start(self, trainer, pl_module) -> None:
        # configure_model ran inside the strategy's zero.Init: count what this rank really holds.
        self.record["local_elements"] = local_element_count(pl_module.model)
        self.record["full_elements"] = full_element_count(pl_module.model)
        self.record["materialised_elements"] = sum(p.numel() for p in pl_module.model.parameters())
        self.record["logits_before"] = self._probe_logits(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.record["losses"].append(float(outputs["loss"]))
        epoch = str(trainer.current_epoch)
        self.record["samples"].setdefault(epoch, []).extend(batch["sample_index"].tolist())

    def on_train_end(self, trainer, pl_module) -> None:
        self.record["logits_after"] = self._probe_logits(pl_module)

    def _probe_logits(self, pl_module):
        if self.probe is None:
            return None
        pl_module.eval()
        with torch.no_grad():
            logits = pl_module(input_ids=self.probe).logits
        pl_module.train()
        return logits.tolist()


def run_job(job: dict, options: dict, out: Path) -> dict:
    L.seed_everything(job.get("seed", 0), verbose=False)
    strategy = lightning_hpz.HpzStrategy(**{**options["strategy"], **job.get("strategy", {})})
    data_class = SpanCorruptionDataModule if job["family"] == "t5" else CausalLMDataModule
    data = data_class(cache_dir=str(out / "token_cache"), **job["data"])
    model = MODELS[job["family"]](**job["model"])
    recorder = Recorder(job.get("probe"))
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=options.get("devices", 4),
        max_steps=job["steps"],
        limit_val_batches=0,
        callbacks=[recorder],
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data)
    return {"rank": trainer.global_rank, **recorder.record}


def main(options: dict) -> None:
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    records = {job["name"]: run_job(job, options, out) for job in options["jobs"]}
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    (out / f"rank{rank}.json").write_text(json.dumps({"jobs": records}))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
