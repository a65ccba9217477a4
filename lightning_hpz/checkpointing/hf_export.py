"""``lightning-hpz export CKPT_DIR OUT_DIR``: a training checkpoint as a Hugging Face model directory + tokenizer.

The sharded checkpoint is consolidated to fp32, the transformers model is rebuilt from the config the
:class:`~lightning_hpz.models.LanguageModel` stored in the checkpoint, and the directory that ``save_pretrained``
writes gets the tokenizer the data module used, so ``AutoModelForCausalLM`` / ``AutoModelForSeq2SeqLM`` and
``AutoTokenizer`` load it with no further step.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

EXPORT_KEY = "huggingface_export"  # what LanguageModel.on_save_checkpoint writes: family, config, tokenizer


class ExportError(ValueError):
    """A checkpoint that cannot become a Hugging Face directory, with the reason and what to do instead."""


def export_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path, tokenizer: Optional[str] = None) -> Path:
    """Write ``out_dir`` from ``checkpoint_dir``; ``tokenizer`` overrides the one recorded at training time."""
    checkpoint = _consolidated(checkpoint_dir)
    recorded = checkpoint.get(EXPORT_KEY)
    if recorded is None:
        raise ExportError(
            f"{checkpoint_dir} was not written by a lightning_hpz LanguageModel (Llama2, Falcon, T5), so it holds no "
            "model config to rebuild from. For your own LightningModule, use `lightning-hpz consolidate` and "
            "`YourModule.load_from_checkpoint(...)`."
        )
    model = _rebuilt_model(recorded, checkpoint["state_dict"])
    out_dir = Path(out_dir)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    _save_tokenizer(tokenizer or recorded.get("tokenizer") or "byte", out_dir)
    return out_dir


def _consolidated(checkpoint_dir: str | Path) -> dict[str, Any]:
    from lightning_hpz.checkpointing.consolidate import consolidate

    with tempfile.TemporaryDirectory() as scratch:
        return consolidate(checkpoint_dir, Path(scratch) / "consolidated.ckpt")


def _rebuilt_model(recorded: dict[str, Any], state_dict: dict[str, Any]) -> Any:
    import torch

    from lightning_hpz.models.architectures import build_hf_model, hf_config

    with torch.device("meta"):  # the weights come from the checkpoint: allocate nothing twice
        model = build_hf_model(recorded["family"], hf_config(recorded["family"], recorded["config"]))
    weights = {name.removeprefix("model."): t for name, t in state_dict.items() if name.startswith("model.")}
    model.load_state_dict(weights, strict=False, assign=True)
    model.tie_weights()  # a tied matrix is stored once
    unloaded = [name for name, p in model.named_parameters() if p.is_meta]
    if unloaded:
        raise ExportError(f"The checkpoint lacks weights for {unloaded[:5]}: it does not match its recorded config.")
    return model


def _save_tokenizer(spec: str, out_dir: Path) -> None:
    if spec == "byte":
        from lightning_hpz.data.byte_tokenizer_hf import byte_tokenizer_as_huggingface
        from lightning_hpz.data.tokenizers import ByteTokenizer

        byte_tokenizer_as_huggingface(ByteTokenizer()).save_pretrained(str(out_dir))
        return
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(spec, local_files_only=True).save_pretrained(str(out_dir))


def export_main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="lightning-hpz export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint_dir", help="the .ckpt directory ModelCheckpoint wrote (Llama2, Falcon or T5)")
    parser.add_argument("out_dir", help="the Hugging Face directory to write (config, safetensors, tokenizer)")
    parser.add_argument("--tokenizer", help="'byte' or a local tokenizer directory; default: the one trained with")
    args = parser.parse_args(list(argv))
    out_dir = export_checkpoint(args.checkpoint_dir, args.out_dir, args.tokenizer)
    print(f"wrote {out_dir}: load it with AutoModelForCausalLM/AutoModelForSeq2SeqLM and AutoTokenizer")
