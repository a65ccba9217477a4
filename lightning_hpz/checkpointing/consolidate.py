"""Consolidate a sharded (ZeRO 1/2/3) Lightning + DeepSpeed checkpoint into one fp32 state-dict file."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_hpz.checkpointing import manifest
from lightning_hpz.checkpointing.errors import CheckpointIntegrityError


class CheckpointNotFoundError(FileNotFoundError):
    """The path given is not a checkpoint directory written by a DeepSpeed-based strategy."""


def validate_checkpoint_dir(path: str | Path) -> Path:
    """The checkpoint directory, or an error that says what is wrong with ``path``."""
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(
            f"No checkpoint at {str(path)!r}. Pass the `.ckpt` directory ModelCheckpoint wrote."
        )
    if not path.is_dir() or not (path / "latest").is_file():
        raise CheckpointNotFoundError(
            f"{str(path)!r} is not a sharded DeepSpeed checkpoint (a directory holding a 'latest' file). "
            "HpzStrategy saves each checkpoint as such a directory; a single-file checkpoint needs no consolidation."
        )
    return path


def consolidate(checkpoint_dir: str | Path, output_file: str | Path) -> dict[str, Any]:
    """Write ``output_file``: a Lightning checkpoint whose ``state_dict`` holds the full fp32 weights."""
    from lightning_hpz import lightning_internals

    checkpoint_dir = validate_checkpoint_dir(checkpoint_dir)
    _refuse_damaged(checkpoint_dir)
    Path(output_file).parent.mkdir(parents=True, exist_ok=True)
    try:
        return lightning_internals.convert_zero_checkpoint(str(checkpoint_dir), str(output_file))
    except Exception as error:
        # Without a manifest, DeepSpeed's reader fails on a damaged file without naming it ("Invalid argument").
        unreadable = manifest.unreadable_archives(checkpoint_dir)
        if unreadable:
            raise CheckpointIntegrityError(manifest.damage_report(checkpoint_dir, unreadable)) from error
        raise


def _refuse_damaged(checkpoint_dir: Path) -> None:
    recorded = manifest.read_manifest(checkpoint_dir)
    problems = manifest.verify_files(checkpoint_dir, recorded, list(recorded["files"])) if recorded else []
    if problems:
        raise CheckpointIntegrityError(manifest.damage_report(checkpoint_dir, problems))


def consolidate_main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="lightning-hpz consolidate", description=consolidate.__doc__)
    parser.add_argument("checkpoint_dir", help="the .ckpt directory written by ModelCheckpoint under HpzStrategy")
    parser.add_argument("output_file", help="where to write the consolidated fp32 checkpoint (.pt/.ckpt)")
    args = parser.parse_args(list(argv))
    state = consolidate(args.checkpoint_dir, args.output_file)
    print(f"wrote {args.output_file}: {len(state['state_dict'])} tensors")
