"""Layers that draw random numbers while training, which no checkpoint can replay.

Neither Lightning's checkpoint nor DeepSpeed's keeps the random generators' states, so dropout masks after a resume
differ from those the uninterrupted run draws: losses agree at the first step after resume at best. Warn instead of
letting a user believe the continuation is exact.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules.dropout import _DropoutNd


def active_dropout_layers(module: nn.Module) -> list[str]:
    """Names of the dropout layers of ``module`` that drop anything (``p > 0``)."""
    return [name for name, layer in module.named_modules() if isinstance(layer, _DropoutNd) and layer.p > 0]


def warn_if_resume_draws_random_numbers(module: nn.Module) -> None:
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    layers = active_dropout_layers(module)
    if layers:
        rank_zero_warn(
            f"Resume cannot continue exactly: {len(layers)} dropout layer(s) ({', '.join(layers[:3])}"
            f"{', ...' if len(layers) > 3 else ''}) draw random masks, and no checkpoint keeps the random generators' "
            "states. Set their p=0 (e.g. for fine-tuning) where an exact continuation matters."
        )
