"""``lightning-hpz``: LightningCLI for training (fit/validate/test/predict) plus the package's own tools.

``lightning-hpz fit --config configs/quickstart.yaml`` trains (from any folder: a ``--config`` that is no file names
a shipped config, see :mod:`lightning_hpz.cli.shipped_configs`); ``lightning-hpz strategies`` lists the registered
strategy names; ``lightning-hpz consolidate`` turns a sharded checkpoint into one fp32 state dict. Further tools
register in :data:`TOOLS` as ``name -> (module path, function name, one-line help)``; each takes ``argv``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Optional

from lightning_hpz.cli.shipped_configs import shipped_names, with_shipped_configs

TOOLS: dict[str, tuple[str, str, str]] = {
    "strategies": ("lightning_hpz.cli.main", "print_strategies", "list the strategy names registered by lightning_hpz"),
    "consolidate": (
        "lightning_hpz.checkpointing.consolidate",
        "consolidate_main",
        "merge a sharded DeepSpeed checkpoint into one fp32 state-dict file",
    ),
    "checkpoint": (
        "lightning_hpz.checkpointing.inspect_command",
        "checkpoint_main",
        "inspect a sharded checkpoint: stage, world size, step, integrity manifest, sizes",
    ),
    "export": (
        "lightning_hpz.checkpointing.hf_export",
        "export_main",
        "write a training checkpoint as a Hugging Face model directory with its tokenizer",
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
        "lightning_hpz.cli.plan_command",
        "plan_main",
        "predict bytes, communication time and memory per rank for each ZeRO stage, hpZ and ZeRO++",
    ),
    "study": ("lightning_hpz.study.command", "study_main", "scaling study: ZeRO stage x model x micro-batch"),
}
TRAINER_COMMANDS = ("fit", "validate", "test", "predict")
CONFIG_COMMANDS = (*TRAINER_COMMANDS, "study")  # their --config may name a shipped config


def main(argv: Optional[Sequence[str]] = None) -> None:
    from_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in CONFIG_COMMANDS:
        argv = with_shipped_configs(argv)
        if from_command_line:  # LightningCLI and the ranks Lightning launches read the command line itself
            sys.argv[1:] = argv
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
    lines += ["", "shipped configs (--config NAME, from any folder):", *(f"  {name}" for name in shipped_names())]
    return "\n".join(lines)


def run_lightning_cli(argv: Sequence[str]) -> None:
    from lightning.pytorch.cli import LightningCLI

    from lightning_hpz.strategy.registration import register_now

    register_now()  # "hpz" and friends, before the Trainer parses `strategy:`

    from lightning_hpz.cli.errors import user_facing_message
    from lightning_hpz.cli.trained_steps import StepAtTrainStart, refuse_run_that_trained_nothing

    start = StepAtTrainStart()
    try:
        cli = LightningCLI(
            subclass_mode_model=True,
            subclass_mode_data=True,
            trainer_defaults={"callbacks": [start]},  # persistent: a config's own callbacks come in addition
            # None when argv is the command line itself: LightningCLI warns when given sys.argv as `args`
            args=None if list(argv) == sys.argv[1:] else list(argv),
            auto_configure_optimizers=False,
        )
    except Exception as error:
        message = user_facing_message(error)
        if message is None:
            raise
        sys.exit(f"\nlightning-hpz {argv[0]}: error: {message}")
    if cli.subcommand == "fit":
        refuse_run_that_trained_nothing(cli.trainer, start)


def print_strategies(argv: Sequence[str] = ()) -> None:
    """Print each strategy name lightning_hpz registers, with its description."""
    from lightning_hpz.strategy.presets import STRATEGY_PRESETS

    width = max(len(name) for name, _, _ in STRATEGY_PRESETS)
    for name, description, _ in STRATEGY_PRESETS:
        print(f"{name:<{width}}  {description}")
