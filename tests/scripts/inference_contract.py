"""Lightning's DeepSpeed contract for validate/test/predict, for several strategy settings in one launch.

Run as ``python inference_contract.py '<json options>'`` (Lightning's launcher re-executes it once per extra rank).
For each entry of ``runs`` (a name, strategy kwargs and a model kind), in this order and in the same processes:

1. ``validate`` an untrained model on a fresh Trainer (an inference engine before any training engine exists);
2. ``fit``, save a checkpoint, then ``validate``, ``test`` and ``predict`` on the same Trainer;
3. ``validate``, ``test`` and ``predict`` of a newly built model on a fresh Trainer from that checkpoint.

Each rank writes ``rank<r>.json`` with every metric and its predictions, per run.
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.utils.data import DataLoader, TensorDataset

import lightning_hpz


def fixed_data(seed: int) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(32, 32, generator=generator)), batch_size=4)


class ScoredBoringModel(BoringModel):
    """Lightning's BoringModel (its layer built in ``__init__``), logging its loss and reading fixed data."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch[0], batch_idx)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.step(batch[0]), sync_dist=True)
        if self.trainer.state.fn != "fit":  # fit validates under no_grad on every backend (Lightning's choice)
            self.evaluation_modes.add(torch.is_inference_mode_enabled())

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.step(batch[0]), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        self.evaluation_modes.add(torch.is_inference_mode_enabled())
        return self(batch[0])

    @property
    def evaluation_modes(self) -> set:
        # whether validate and predict ran under torch.inference_mode (Lightning's CUDA branch) or not
        return EVALUATION_MODES

    def train_dataloader(self):
        return fixed_data(1)

    def val_dataloader(self):
        return fixed_data(2)

    def test_dataloader(self):
        return fixed_data(2)

    def predict_dataloader(self):
        return fixed_data(3)


class ConfiguredBoringModel(ScoredBoringModel):
    """The same model with its layer built in ``configure_model`` (under ``deepspeed.zero.Init`` for ZeRO-3)."""

    def __init__(self) -> None:
        super().__init__()
        del self.layer

    def configure_model(self) -> None:
        if not hasattr(self, "layer"):
            self.layer = torch.nn.Linear(32, 2)


EVALUATION_MODES: set = set()
MODELS = {"boring": ScoredBoringModel, "configured": ConfiguredBoringModel}


def make_trainer(strategy_kwargs: dict, devices: int, **kwargs) -> L.Trainer:
    return L.Trainer(
        strategy=lightning_hpz.HpzStrategy(**strategy_kwargs),
        accelerator="cpu",
        devices=devices,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def predictions(batches: list) -> list:
    return torch.cat(batches).flatten().tolist()


def one_run(run: dict, devices: int, out: Path) -> dict:
    model_class, strategy_kwargs = MODELS[run["model"]], run["strategy"]
    record: dict = {}
    L.seed_everything(0, verbose=False)
    untrained = make_trainer(strategy_kwargs, devices)
    record["untrained_val"] = untrained.validate(model_class(), verbose=False)[0]["val_loss"]

    L.seed_everything(0, verbose=False)
    trainer, model = make_trainer(strategy_kwargs, devices), model_class()
    trainer.fit(model)
    checkpoint = out / run["name"] / "last.ckpt"
    trainer.save_checkpoint(checkpoint)
    record["after_fit"] = {
        "val": trainer.validate(model, verbose=False)[0]["val_loss"],
        "test": trainer.test(model, verbose=False)[0]["test_loss"],
        "predict": predictions(trainer.predict(model)),
    }

    L.seed_everything(1, verbose=False)  # a different initialization: only the checkpoint can make results agree
    fresh, new_model = make_trainer(strategy_kwargs, devices), model_class()
    record["from_checkpoint"] = {
        "val": fresh.validate(new_model, ckpt_path=checkpoint, verbose=False)[0]["val_loss"],
        "test": fresh.test(new_model, ckpt_path=checkpoint, verbose=False)[0]["test_loss"],
        "predict": predictions(fresh.predict(new_model, ckpt_path=checkpoint)),
    }
    record["zero_config"] = trainer.strategy.config.get("zero_optimization")
    record["global_rank"] = trainer.global_rank
    record["inference_mode_seen"] = sorted(EVALUATION_MODES)
    return record


def main(options: dict) -> None:
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    records = {run["name"]: one_run(run, options["devices"], out) for run in options["runs"]}
    rank = next(iter(records.values()))["global_rank"]
    (out / f"rank{rank}.json").write_text(json.dumps(records))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
