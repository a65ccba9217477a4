"""The training step the Fabric checkpoint scripts share: one step on the batch of ``step`` and this rank, the same
in every run, so that two runs can be compared step by step."""

import lightning as L
import torch
from torch import nn


def train_step(fabric: L.Fabric, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * step + fabric.global_rank))
    loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin())
    fabric.backward(loss, model=model)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()
