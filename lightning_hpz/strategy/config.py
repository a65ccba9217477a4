"""The DeepSpeed config of an :class:`~lightning_hpz.HpzStrategy`: user config merged over defaults, validated.

Pure functions: no process group, no model. Every error says what is wrong and how to fix it, and is raised while
the Trainer is being built, before any process is launched.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import yaml
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.rank_zero import rank_zero_info

HpzSize = Union[int, str, None]
# Lightning's DeepSpeedStrategy.DEEPSPEED_ENV_VAR: a config file used when no ``config=`` is given
DEEPSPEED_ENV_VAR = "PL_DEEPSPEED_CONFIG_PATH"


class HpzConfigurationError(MisconfigurationException, ValueError):
    """A strategy setting that cannot work, with the fix in the message.

    A ``MisconfigurationException``, as Lightning's DeepSpeedStrategy raises for the same mistakes, and a
    ``ValueError``.
    """


@dataclass(frozen=True)
class ZeroPlusPlusSettings:
    """The ZeRO++ knobs as resolved from kwargs and ``config=`` (``None`` where neither gave a value)."""

    stage: int
    hpz_partition_size: HpzSize
    quantized_weights: bool
    quantized_gradients: bool


# strategy kwarg -> key inside the DeepSpeed ``zero_optimization`` section
ZERO_KEYS = {
    "stage": "stage",
    "hpz_partition_size": "zero_hpz_partition_size",
    "quantized_weights": "zero_quantized_weights",
    "quantized_gradients": "zero_quantized_gradients",
}
DEFAULTS = {"stage": 3, "hpz_partition_size": "auto", "quantized_weights": False, "quantized_gradients": False}


class UnsetDefault(int):
    """A default that shows its real value (``--print_config`` prints ``stage: 3``) yet counts as "not given", so a
    ``zero_optimization.stage`` in ``config=`` may still set the stage without being called a conflict."""


DEFAULT_STAGE = UnsetDefault(DEFAULTS["stage"])
# LightningCLI writes its config (and --print_config) with PyYAML's safe dumper, which knows plain ints only.
yaml.SafeDumper.add_representer(UnsetDefault, lambda dumper, value: dumper.represent_int(int(value)))


def user_config_source(config: Union[dict[str, Any], str, os.PathLike, None]) -> tuple[Any, str]:
    """``config=`` if given, else the file named by ``PL_DEEPSPEED_CONFIG_PATH`` (as Lightning chooses), and its name.

    Either is then read the same way: merged over the strategy's defaults, its ZeRO stage respected.
    """
    if config is None and os.environ.get(DEEPSPEED_ENV_VAR):
        rank_zero_info(f"Loading the DeepSpeed config from {DEEPSPEED_ENV_VAR}={os.environ[DEEPSPEED_ENV_VAR]}")
        return os.environ[DEEPSPEED_ENV_VAR], DEEPSPEED_ENV_VAR
    return config, "config"


def load_user_config(config: Union[dict[str, Any], str, os.PathLike, None], name: str = "config") -> dict[str, Any]:
    """Read ``config`` (a dict or a path to a JSON file) into a fresh dict; ``name`` says where it came from."""
    if config is None:
        return {}
    if isinstance(config, dict):
        return copy.deepcopy(config)
    path = Path(config)
    if not path.is_file():
        raise HpzConfigurationError(
            f"{name}={str(config)!r}: no such file. Pass the path of a DeepSpeed JSON config, or a dict."
        )
    try:
        loaded = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise HpzConfigurationError(
            f"{name}={str(config)!r} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}). "
            "Fix the file, or pass the settings as a dict."
        ) from err
    if not isinstance(loaded, dict):
        raise HpzConfigurationError(
            f"{name}={str(config)!r} holds a {type(loaded).__name__}; it must be a JSON object."
        )
    return loaded


def merge_configs(defaults: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``override`` over ``defaults``: nested sections merge key by key, the override wins leaf values."""
    merged = copy.deepcopy(defaults)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_configs(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def resolve_zero_settings(
    kwargs: dict[str, Any], user_config: dict[str, Any], zero_optimization: bool = True
) -> ZeroPlusPlusSettings:
    """Combine explicit kwargs (``None`` = not given) with ``config=``; refuse where both give different values.

    ``zero_optimization=False`` turns ZeRO off, as in Lightning's DeepSpeedStrategy (stage 0: plain data parallel).
    """
    zero_section = user_config.get("zero_optimization") or {}
    # The signature's default stage (shown by --print_config) counts as not given.
    kwargs = {name: None if isinstance(value, UnsetDefault) else value for name, value in kwargs.items()}
    if not zero_optimization:
        _refuse_stage_without_zero(kwargs.get("stage"), zero_section.get("stage"))
        kwargs = {**kwargs, "stage": 0}
    resolved = {}
    for name, key in ZERO_KEYS.items():
        given, configured = kwargs.get(name), zero_section.get(key)
        if given is not None and configured is not None and given != configured:
            raise HpzConfigurationError(
                f"{name}={given!r} conflicts with zero_optimization.{key}={configured!r} in config=. "
                "Give the value in one place only."
            )
        resolved[name] = next(v for v in (given, configured, DEFAULTS[name]) if v is not None)
    return ZeroPlusPlusSettings(**resolved)


def _refuse_stage_without_zero(given: Any, configured: Any) -> None:
    for where, stage in (("stage", given), ("zero_optimization.stage in config=", configured)):
        if stage not in (None, 0):
            raise HpzConfigurationError(
                f"zero_optimization=False turns ZeRO off, but {where}={stage!r} asks for ZeRO stage {stage}. "
                "Remove one of the two."
            )


def validate_settings(settings: ZeroPlusPlusSettings) -> None:
    """Checks that need no knowledge of the cluster."""
    if settings.stage not in (0, 1, 2, 3):
        raise HpzConfigurationError(
            f"stage={settings.stage!r} is not a ZeRO stage; use 1, 2 or 3 (0 or zero_optimization=False: ZeRO off)."
        )
    size = settings.hpz_partition_size
    if isinstance(size, str) and size != "auto":
        raise HpzConfigurationError(f"hpz_partition_size={size!r}: give a positive int, or 'auto' (devices per node).")
    if isinstance(size, bool) or (isinstance(size, (int, float)) and (size != int(size) or size < 1)):
        raise HpzConfigurationError(
            f"hpz_partition_size={size!r} must be a positive whole number (1 turns hpZ off), or 'auto'."
        )
    if isinstance(size, int) and size > 1 and settings.stage != 3:
        raise HpzConfigurationError(
            f"hpz_partition_size={size} needs ZeRO stage 3 (hpZ keeps a secondary copy of partitioned parameters), "
            f"but stage={settings.stage}. Use stage=3, or hpz_partition_size=1."
        )
    for name in ("quantized_weights", "quantized_gradients"):
        if getattr(settings, name) and settings.stage != 3:
            raise HpzConfigurationError(f"{name}=True (ZeRO++) needs stage=3, but stage={settings.stage}.")


def resolve_partition_size(size: HpzSize, stage: int, devices_per_node: int, num_nodes: int) -> tuple[int, str]:
    """The hpZ partition size to configure, and a line for the log saying how it was chosen."""
    if size == "auto":
        if stage != 3:
            return 1, f"hpZ off: it needs ZeRO stage 3 (stage={stage})."
        if num_nodes == 1:
            return 1, "hpZ off: a single node has no cross-node traffic to save (hpz_partition_size='auto')."
        return devices_per_node, f"hpZ partition size {devices_per_node} (= devices per node, 'auto')."
    return int(size), f"hpZ partition size {int(size)}."


def validate_layout(partition_size: int, devices_per_node: int, num_nodes: int) -> None:
    """hpZ groups are consecutive global ranks; each must lie inside one node (Lightning numbers ranks node-major)."""
    world_size = devices_per_node * num_nodes
    if partition_size <= 1:
        return
    if devices_per_node == 1:
        raise HpzConfigurationError(
            f"hpz_partition_size={partition_size} needs more than one device per node: hpZ shards its secondary copy "
            "over the devices of one node, and this run has one device per node. Use devices=N (N > 1, a multiple "
            f"of {partition_size}; on CPU each device is a process), or hpz_partition_size=1."
        )
    if world_size % partition_size:
        raise HpzConfigurationError(
            f"hpz_partition_size={partition_size} does not divide the world size {world_size} "
            f"({num_nodes} node(s) x {devices_per_node} device(s)). Use a divisor of {devices_per_node}, "
            "usually the number of devices per node."
        )
    if devices_per_node % partition_size:
        raise HpzConfigurationError(
            f"hpz_partition_size={partition_size} is not a divisor of the {devices_per_node} devices per node, so a "
            "secondary group would span two nodes and its gathers would cross the slow link. "
            f"Use a divisor of {devices_per_node}."
        )


def validate_hpz_companions(config: dict[str, Any], partition_size: int) -> None:
    """Refuse the features next to which hpZ (a size above 1) is silently off or crashes inside DeepSpeed."""
    if partition_size <= 1:
        return
    if (config.get("compile") or {}).get("deepcompile"):
        raise HpzConfigurationError(
            f"hpz_partition_size={partition_size} with DeepCompile (compile.deepcompile=true): DeepCompile schedules "
            "ZeRO-3's gathers itself and never keeps or reads hpZ's secondary partitions, so hpZ would be silently "
            "off. Set hpz_partition_size=1, or remove compile.deepcompile."
        )
    zero = config.get("zero_optimization") or {}
    if (zero.get("mics_shard_size") or -1) > 0:
        raise HpzConfigurationError(
            f"hpz_partition_size={partition_size} with MiCS (zero_optimization.mics_shard_size="
            f"{zero['mics_shard_size']}): DeepSpeed builds the MiCS optimizer before hpZ's groups and never keeps a "
            "secondary partition, so hpZ would be silently off. Use one of the two: remove mics_shard_size, or set "
            "hpz_partition_size=1."
        )
    if (config.get("expert_parallel") or {}).get("enabled"):
        raise HpzConfigurationError(
            f"hpz_partition_size={partition_size} with AutoEP (expert_parallel.enabled=true): DeepSpeed's AutoEP under "
            "ZeRO-3 does not support hpZ's secondary groups and stops at engine start-up. Set hpz_partition_size=1, "
            "or disable expert_parallel."
        )
    offload = zero.get("offload_param") or {}
    if offload.get("device") == "nvme":
        raise HpzConfigurationError(
            f"hpz_partition_size={partition_size} with parameters offloaded to NVMe (offload_param.device='nvme'): "
            "DeepSpeed's NVMe parameter swapper does not handle hpZ's secondary partitions and fails inside ZeRO-3. "
            "Offload parameters to 'cpu', or set hpz_partition_size=1."
        )


# DeepSpeed #7775 (fixed in 0.19.6): qwZ's CUDA quantizer read bf16 weights through an fp16 pointer.
QWZ_BF16_FIXED = "0.19.6"


def validate_qwz_precision(quantized_weights: bool, bf16: bool, deepspeed_version: str) -> None:
    """Refuse qwZ on bf16 weights where the installed DeepSpeed quantizes their bits as if they were fp16."""
    from packaging.version import Version

    if not (quantized_weights and bf16) or Version(Version(deepspeed_version).base_version) >= Version(QWZ_BF16_FIXED):
        return
    raise HpzConfigurationError(
        f"quantized_weights=True (ZeRO++ qwZ) with bf16 on DeepSpeed {deepspeed_version}: before {QWZ_BF16_FIXED} "
        "DeepSpeed's weight quantizer reads bf16 values as fp16 bits and gathers garbage (DeepSpeed issue 7775). "
        f'Install a fixed release (`pip install "deepspeed>={QWZ_BF16_FIXED}"`), train in fp16, or set '
        "quantized_weights=False."
    )


def validate_qgz_groups(visible_gpus: int, devices_per_node: int) -> None:
    """qgZ groups a node's ranks by the GPUs each process sees: they must be exactly the node's training devices."""
    if visible_gpus == devices_per_node:
        return
    raise HpzConfigurationError(
        f"quantized_gradients=True (ZeRO++ qgZ): DeepSpeed groups each node's ranks by the GPUs a process sees "
        f"({visible_gpus}), but this run trains on {devices_per_node} device(s) per node, so its gradient groups would "
        f"span nodes or fail to build. Train on every GPU a process sees (devices={visible_gpus}), or show each "
        f"process only the node's training GPUs (CUDA_VISIBLE_DEVICES with {devices_per_node} entries), or set "
        "quantized_gradients=False."
    )


def validate_activation_checkpointing(config: dict[str, Any]) -> None:
    """DeepSpeed asserts on these only when the first model is set up; refuse them while the strategy is built."""
    section = config.get("activation_checkpointing") or {}
    if not section.get("contiguous_memory_optimization"):
        return
    if not section.get("partition_activations"):
        raise HpzConfigurationError(
            "contiguous_memory_optimization=True copies partitioned activations into one buffer, so it needs "
            "partition_activations=True too. Set partition_activations=True, or contiguous_memory_optimization=False."
        )
    layers = section.get("number_checkpoints")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise HpzConfigurationError(
            "contiguous_memory_optimization=True sizes its buffer by the number of checkpointed layers, but "
            f"activation_checkpointing.number_checkpoints is {layers!r}. Pass "
            "config={'activation_checkpointing': {'number_checkpoints': <checkpointed layers>}}, "
            "or set contiguous_memory_optimization=False."
        )


def validate_checkpoint_writer(config: dict[str, Any]) -> None:
    """Refuse DeepSpeed's asynchronous checkpoint writers: the package commits a checkpoint (checksums, manifest,
    rename over the previous one) when the save returns, and with these the files are still being written then, so
    the commit would certify incomplete files and delete the last complete checkpoint."""
    writer = (config.get("checkpoint") or {}).get("writer") or {}
    if writer.get("decoupled"):
        raise HpzConfigurationError(
            "checkpoint.writer.decoupled=True makes DeepSpeed write checkpoints in the background, after the save "
            "returns; lightning_hpz commits a checkpoint (checksums, manifest, replacing the previous one) when the "
            "save returns, so it would certify files still being written. Set checkpoint.writer.decoupled=False "
            "(the fast writer still writes in parallel) or remove checkpoint.writer."
        )
    if config.get("datastates_ckpt", False) is not False:
        raise HpzConfigurationError(
            "datastates_ckpt enables DataStates' asynchronous checkpoint engine, which returns before the files are "
            "written; lightning_hpz commits a checkpoint when the save returns and would certify incomplete files. "
            "Remove datastates_ckpt from the DeepSpeed config."
        )


def zero_section(settings: ZeroPlusPlusSettings, partition_size: int) -> dict[str, Any]:
    """The ``zero_optimization`` keys this package owns."""
    section: dict[str, Any] = {"stage": settings.stage}
    if settings.stage == 3:
        section[ZERO_KEYS["hpz_partition_size"]] = partition_size
        section[ZERO_KEYS["quantized_weights"]] = settings.quantized_weights
        section[ZERO_KEYS["quantized_gradients"]] = settings.quantized_gradients
    return section
