"""An existing Lightning project switched to hpZ by one import and one Trainer argument.

    python examples/existing_project.py                      # 4 CPU processes, Lightning launches them
    torchrun --nproc-per-node 4 examples/existing_project.py # the same under torchrun
    python examples/existing_project.py --devices 8 --accelerator cuda --num-nodes 2 --hpz auto

Nothing below is specific to lightning_hpz except ``import lightning_hpz`` and the ``strategy=`` argument.
"""

import argparse
import json
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_hpz


class Classifier(L.LightningModule):
    """A plain two-layer classifier, as found in any Lightning project."""

    def __init__(self, features: int = 64, classes: int = 8, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(features, 256), nn.ReLU(), nn.Linear(256, classes))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class LossRecorder(L.Callback):
    """Keeps this rank's training losses, for the summary."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def make_data(features: int = 64, classes: int = 8, size: int = 2048) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(size, features, generator=generator)
    y = (x @ torch.randn(features, classes, generator=generator)).argmax(dim=1)
    return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--hpz", default="2", help="hpZ partition size, or 'auto' (devices per node)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--summary", type=Path, help="write each rank's first/last loss here (JSON per rank)")
    args = parser.parse_args()

    L.seed_everything(0)
    hpz = args.hpz if args.hpz == "auto" else int(args.hpz)
    recorder = LossRecorder()
    trainer = L.Trainer(
        strategy=lightning_hpz.HpzStrategy(hpz_partition_size=hpz),
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        callbacks=[recorder],
    )
    trainer.fit(Classifier(), make_data())
    losses = recorder.losses
    if args.summary:
        args.summary.mkdir(parents=True, exist_ok=True)
        record = {"first_loss": losses[0], "last_loss": losses[-1], "steps": len(losses)}
        (args.summary / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
