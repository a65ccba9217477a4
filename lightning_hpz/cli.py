"""``lightning-hpz``: LightningCLI for training (fit/validate/test/predict) plus the package's own tools.

``lightning-hpz fit --config configs/quickstart.yaml`` trains; ``lightning-hpz strategies`` lists the registered
strategy names; ``lightning-hpz consolidate`` turns a sharded checkpoint into one fp32 state dict. Further tools
register in :data:`TOOLS` as ``name -> (module path, function name, one-line help)``; each takes ``argv``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Optional

TOOLS: dict[str, tuple[str, str, str]] = {
    "strategies": ("lightning_hpz.cli", "print_strategies", "list the strategy names registered by lightning_hpz"),
    "consolidate": (
        "lightning_hpz.checkpoint",
        "consolidate_main",
        "merge a sharded DeepSpeed checkpoint into one fp32 state-dict file",
    ),
    "bench": (
        "lightning_hpz.bench.command",
        "bench_main",
        "train under ZeRO-1/2/3, hpZ, FSDP2 and DDP on a two-node rate-limited testbed (root)",
    ),
    "presets": (
        "lightning_hpz.models.presets",
        "print_presets",
        "list the model presets: family and exact parameter count (built on the meta device)",
    ),
    "prepare-data": (
        "lightning_hpz.data.prepare_command",
        "prepare_data_main",
        "tokenize a corpus once, in parallel, into memory-mapped token shards that training reads directly",
    ),
    "plan": (
        "lightning_hpz.planning.plan_command",
        "plan_main",
        "predict bytes, communication time and memory per rank for each ZeRO stage, hpZ and ZeRO++",
    ),
}
TRAINER_COMMANDS = ("fit", "validate", "test", "predict")


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in TOOLS:
        module, function, _ = TOOLS[argv[0]]
        getattr(importlib.import_module(module), function)(argv[1:])
        return
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return
    run_lightning_cli(argv)


def usage() -> str:
    lines = ["usage: lightning-hpz COMMAND [options]", "", "training (LightningCLI; see COMMAND --help):"]
    lines += [f"  {name}" for name in TRAINER_COMMANDS]
    lines += ["", "tools:"]
    lines += [f"  {name:<12} {help_text}" for name, (_, _, help_text) in TOOLS.items()]
    return "\n".join(lines)


def run_lightning_cli(argv: Sequence[str]) -> None:
    from lightning.pytorch.cli import LightningCLI

    import lightning_hpz  # noqa: F401 - registers "hpz" and friends before the Trainer parses `strategy:`

    LightningCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=list(argv),
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
    )


def print_strategies(argv: Sequence[str] = ()) -> None:
    """Print each strategy name lightning_hpz registers, with its description."""
    from lightning_hpz.strategy import STRATEGY_PRESETS

    width = max(len(name) for name, _, _ in STRATEGY_PRESETS)
    for name, description, _ in STRATEGY_PRESETS:
        print(f"{name:<{width}}  {description}")


if __name__ == "__main__":
    main()
