"""lightning_hpz's own models trained under HpzStrategy, launched as a script (one process per rank).

Run as ``python model_training.py '<json options>'``. ``options["jobs"]`` is a list of trainings run one after the
other in the same processes (one hpZ size per script: DeepSpeed's secondary process group is global). Each rank
writes ``rank<r>.json`` into ``out``: per job, the losses, the sample indices it trained on per epoch, how many
parameter elements it held after the model was built, (for probe jobs) logits before and after training, and (for
``initial_state`` jobs) a digest of every initial parameter and buffer and the initial loss on the first training
samples.
The family ``"user"`` is a LightningModule of the kind a user writes, its layers built in ``configure_model``.
"""

import hashlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import torch
from torch import nn
from torch.utils.data import default_collate

import lightning_hpz
from lightning_hpz.data import CausalLMDataModule, SpanCorruptionDataModule
from lightning_hpz.models import T5, Falcon, Llama2, initialize_by_name
from lightning_hpz.models.sharded_weights import full_element_count, gathered, local_element_count

INITIAL_LOSS_SAMPLES = 4


class UserModel(L.LightningModule):
    """A small causal LM written as a user would: layers built in configure_model, PyTorch's default init for some,
    a GPT-2-style normal(0, 0.02) for the linear layers, applied through ``initialize_by_name``."""

    def __init__(self, vocab_size: int = 384, width: int = 32, learning_rate: float = 1e-3, **_) -> None:
        super().__init__()
        self.vocab_size, self.width, self.learning_rate = vocab_size, width, learning_rate
        self.model = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        self.model = nn.Sequential(
            nn.Embedding(self.vocab_size, self.width),
            nn.Linear(self.width, 4 * self.width),
            nn.GELU(),
            nn.Linear(4 * self.width, self.width),
            nn.LayerNorm(self.width),
            nn.Linear(self.width, self.vocab_size),
        )
        initialize_by_name(self.model, self._init_linear)

    @staticmethod
    def _init_linear(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)

    def forward(self, input_ids, labels, **_):
        logits = self.model(input_ids)  # (B, T, vocab)
        loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return SimpleNamespace(loss=loss, logits=logits)

    def training_step(self, batch, batch_idx):
        return self(batch["input_ids"], batch["labels"]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate)


MODELS = {"llama2": Llama2, "falcon": Falcon, "t5": T5, "user": UserModel}


def parameter_digests(pl_module) -> dict[str, str]:
    """Every parameter's full value (gathered under ZeRO-3) as a SHA-256 of its bytes: equal means bit-identical."""
    params = dict(pl_module.named_parameters())
    with gathered(list(params.values())):
        # float() is exact from bf16, so equal digests still mean equal bits
        values = {name: p.detach().float().cpu().numpy().tobytes() for name, p in params.items()}
    return {name: hashlib.sha256(value).hexdigest() for name, value in values.items()}


def buffer_digests(pl_module) -> dict[str, str]:
    """Every buffer's dtype and a SHA-256 of its bytes (rotary frequencies are buffers, computed, not drawn)."""
    raw = {
        name: b.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes() for name, b in pl_module.named_buffers()
    }
    return {name: f"{b.dtype}:{hashlib.sha256(raw[name]).hexdigest()}" for name, b in pl_module.named_buffers()}


def initial_loss(trainer, pl_module) -> float:
    """The loss of the model as built on the first training samples: the same batch whatever the number of ranks."""
    dataset = trainer.datamodule.train_set
    batch = default_collate([dataset[i] for i in range(INITIAL_LOSS_SAMPLES)])
    input_ids, labels = batch["input_ids"].to(pl_module.device), batch["labels"].to(pl_module.device)
    with torch.no_grad():
        return float(pl_module(input_ids=input_ids, labels=labels).loss)


class Recorder(L.Callback):
    """Collects what the tests assert on, on every rank."""

    def __init__(self, probe: list | None, initial_state: bool = False) -> None:
        self.probe = torch.tensor(probe) if probe is not None else None
        self.initial_state = initial_state
        self.record: dict = {"losses": [], "samples": {}}

    def on_fit_start(self, trainer, pl_module) -> None:
        # configure_model ran inside the strategy's zero.Init: count what this rank really holds.
        self.record["local_elements"] = local_element_count(pl_module.model)
        self.record["full_elements"] = full_element_count(pl_module.model)
        self.record["materialised_elements"] = sum(p.numel() for p in pl_module.model.parameters())
        self.record["logits_before"] = self._probe_logits(pl_module)
        if self.initial_state:
            self.record["parameter_digests"] = parameter_digests(pl_module)
            self.record["buffer_digests"] = buffer_digests(pl_module)
            self.record["initial_loss"] = initial_loss(trainer, pl_module)

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
    recorder = Recorder(job.get("probe"), job.get("initial_state", False))
    trainer = L.Trainer(
        strategy=strategy,
        accelerator=options.get("accelerator", "cpu"),  # "cuda" in benchmarks/gpu_acceptance.py
        devices=options.get("devices", 4),
        max_steps=job["steps"],
        precision=job.get("precision", "32-true"),
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
