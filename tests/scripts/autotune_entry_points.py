"""strategy="hpz_auto" on one CPU process, through every Trainer entry point, a configure_model module and Fabric."""

import json
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_hpz  # noqa: F401 - registers "hpz_auto"
from lightning_hpz import HpzStrategy

TRAINER_ARGS = dict(
    accelerator="cpu", devices=1, max_steps=2, limit_val_batches=2, limit_test_batches=2, limit_predict_batches=2,
    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)  # fmt: skip


class BuiltInConfigureModel(BoringModel):
    """Its layer exists only once configure_model ran (under ZeRO-3's zero.Init)."""

    def __init__(self) -> None:
        super().__init__()
        del self.layer

    def configure_model(self) -> None:
        if not hasattr(self, "layer"):
            self.layer = torch.nn.Linear(32, 2)


def trainer_entry_points() -> dict:
    trainer = L.Trainer(strategy="hpz_auto", **TRAINER_ARGS)
    model = BoringModel()
    trainer.fit(model)
    decision = trainer.strategy.autotune_decision
    return {
        "fit_decision": decision.to_dict(),
        "memory_check": vars(trainer.strategy.autotune_memory_check),
        "preset_name": trainer.strategy.preset_name,
        "validate": trainer.validate(model, verbose=False),
        "test": trainer.test(model, verbose=False),
        "predict_batches": len(trainer.predict(model)),
    }


def budget_too_small() -> dict:
    """A budget every candidate fits on paper, but that the process itself already exceeds: a warning after step 1."""
    trainer = L.Trainer(strategy=HpzStrategy(stage=3, autotune=True, autotune_memory_gib=0.05), **TRAINER_ARGS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(BoringModel())
    check = trainer.strategy.autotune_memory_check
    return {
        "memory_check": vars(check),
        "within_budget": check.within_budget,
        "warnings": [str(w.message) for w in caught if "peaked" in str(w.message)],
        "global_step": trainer.global_step,
    }


def configure_model_module() -> dict:
    trainer = L.Trainer(strategy="hpz_auto", **TRAINER_ARGS)
    trainer.fit(BuiltInConfigureModel())
    return {"decision": trainer.strategy.autotune_decision.to_dict(), "global_step": trainer.global_step}


def fabric_loop() -> dict:
    fabric = L.Fabric(strategy="hpz_auto", accelerator="cpu", devices=1)
    fabric.launch()
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(2):
        loss = model(torch.randn(4, 32)).pow(2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    decision = fabric.strategy.autotune_decision.to_dict()
    memory_check = vars(fabric.strategy.autotune_memory_check)
    fabric.strategy.teardown()
    return {"decision": decision, "loss": float(loss), "memory_check": memory_check}


def main(options: dict) -> None:
    record = {
        "trainer": trainer_entry_points(),
        "small_budget": budget_too_small(),
        "configure_model": configure_model_module(),
        "fabric": fabric_loop(),
    }
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "rank0.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
