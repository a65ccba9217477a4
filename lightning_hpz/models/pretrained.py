"""Local Hugging Face model directories (config.json + safetensors): read into a sharded model, write back.

No hub access: ``pretrained`` is always a local path. Loading works under ZeRO-1/2/3: under ZeRO-3 each parameter
is gathered, written by rank 0 and re-partitioned (the caller then refreshes hpZ's secondary partitions).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from lightning_hpz import collectives
from lightning_hpz.models.architectures import MODEL_TYPES
from lightning_hpz.models.sharded_weights import full_shape, gathered, is_partitioned


class PretrainedModelError(ValueError):
    """A ``pretrained`` directory that is missing, malformed, or does not fit the model."""


def read_pretrained_config(directory: str | Path) -> tuple[str, PretrainedConfig]:
    """The family and transformers config of a local model directory, after checking it holds weights."""
    directory = Path(directory)
    hint = "Pass a local directory written by `save_pretrained` (config.json and *.safetensors)."
    if not directory.is_dir():
        raise PretrainedModelError(f"pretrained={str(directory)!r} is not a directory. {hint}")
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise PretrainedModelError(f"pretrained={str(directory)!r} has no config.json. {hint}")
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
        config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except (json.JSONDecodeError, ValueError, OSError) as err:
        raise PretrainedModelError(f"{config_file} cannot be read as a transformers config: {err}. {hint}") from err
    if model_type not in MODEL_TYPES:
        raise PretrainedModelError(
            f"{config_file} describes model_type={model_type!r}; lightning_hpz builds {sorted(MODEL_TYPES)}."
        )
    if not safetensors_files(directory):
        raise PretrainedModelError(f"pretrained={str(directory)!r} has no *.safetensors weights. {hint}")
    return MODEL_TYPES[model_type], config


def safetensors_files(directory: Path) -> list[Path]:
    return sorted(Path(directory).glob("*.safetensors"))


def _checkpoint_keys(directory: Path) -> dict[str, tuple[Path, torch.Size]]:
    """Every tensor name in the directory's safetensors files -> (file, shape)."""
    keys = {}
    for file in safetensors_files(directory):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                keys[key] = (file, torch.Size(handle.get_slice(key).get_shape()))
    return keys


def _unique_parameters(model: nn.Module) -> list[tuple[list[str], nn.Parameter]]:
    """Each parameter once, with every name it has (tied weights have several)."""
    names: dict[int, list[str]] = defaultdict(list)
    params: dict[int, nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names[id(param)].append(name)
        params[id(param)] = param
    return [(names[key], params[key]) for key in params]


def load_pretrained_weights(model: nn.Module, directory: str | Path) -> int:
    """Copy the weights of ``directory`` into ``model`` (partitioned or not); returns the number of tensors loaded.

    Every rank checks names and shapes before anything is gathered, so a mismatch fails on all ranks alike.
    """
    directory = Path(directory)
    available = _checkpoint_keys(directory)
    plan, missing, mismatched = [], [], []
    for names, param in _unique_parameters(model):
        key = next((n for n in names if n in available), None)
        if key is None:
            missing.append(names[0])
        elif available[key][1] != full_shape(param):
            mismatched.append(f"{key}: checkpoint {tuple(available[key][1])}, model {tuple(full_shape(param))}")
        else:
            plan.append((key, param))
    if missing or mismatched:
        raise PretrainedModelError(
            f"The weights in {directory} do not fit the model built from its config.json: "
            f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}; shape mismatches {mismatched[:5]}. "
            "Was the directory written by this model family's `save_pretrained`?"
        )
    writer = collectives.rank() == 0
    for key, param in plan:
        with gathered([param], modifier_rank=0), torch.no_grad():
            if writer or not is_partitioned(param):
                with safe_open(str(available[key][0]), framework="pt") as handle:
                    param.copy_(handle.get_tensor(key).to(param.dtype))
    return len(plan)


def export_pretrained(model: nn.Module, directory: str | Path) -> None:
    """Write ``model`` (a transformers model, partitioned or not) as a local HF directory, from rank 0.

    Under ZeRO-3 the parameters are gathered one at a time and copied to CPU on rank 0: a collective, so every rank
    must call this. (For models larger than rank 0's CPU memory, consolidate the checkpoint instead.)
    """
    rank = collectives.rank()
    state: dict[str, torch.Tensor] = {}
    for names, param in _unique_parameters(model):
        with gathered([param]):
            if rank == 0:
                state[names[0]] = param.detach().to("cpu", copy=True).contiguous()
    if rank == 0:
        model.save_pretrained(str(directory), state_dict=state, safe_serialization=True)
    collectives.barrier()
