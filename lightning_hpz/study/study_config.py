"""A study's YAML, read into a :class:`StudyConfig` and validated before anything runs.

Every mistake (unknown key, preset, strategy or precision; an empty grid axis; an hpZ size that does not divide the
devices per node; steps that leave nothing to measure) raises :class:`StudyConfigError` naming the problem and the fix.
Model presets and strategy names are looked up in :mod:`lightning_hpz.models.presets` and
:data:`lightning_hpz.strategy.presets.STRATEGY_PRESETS`, imported only while validating.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

ACCELERATORS = ("cpu", "gpu")
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
SPEC_PLACEHOLDER = "{spec}"
TOP_LEVEL_KEYS = (
    "name",
    "description",
    "accelerator",
    "devices_per_node",
    "nodes",
    "steps",
    "warmup_steps",
    "timeout_s",
    "memory_budget_gib",
    "learning_rate",
    "lr_warmup_steps",
    "lr_min_ratio",
    "loss_tolerance",
    "activation_checkpointing",
    "data",
    "deepspeed_config",
    "launcher",
    "env",
    "models",
    "grid",
)
GRID_KEYS = ("models", "strategies", "micro_batch_sizes", "hpz_partition_sizes", "precisions")
DATA_KEYS = ("source", "tokenizer", "sequence_length", "text_field")
MODEL_KEYS = ("family", "config", "scaled_from")


class StudyConfigError(ValueError):
    """A study config that cannot run; the message says what to change."""


@dataclass(frozen=True)
class InlineModel:
    """A model size defined in the study config itself (``models:``), beside the named presets."""

    name: str
    family: str
    config: dict[str, Any]
    scaled_from: Optional[str] = None


@dataclass(frozen=True)
class StudyGrid:
    """The axes whose product is the study's cells (hpZ sizes apply to the strategies that use hpZ only)."""

    models: tuple[str, ...]
    strategies: tuple[str, ...]
    micro_batch_sizes: tuple[int, ...]
    hpz_partition_sizes: tuple[int, ...] = ()
    precisions: tuple[str, ...] = ("32-true",)


@dataclass(frozen=True)
class StudyConfig:
    """Everything one study runs with; see ``configs/study/*.yaml`` for commented examples."""

    name: str
    grid: StudyGrid
    accelerator: str = "cpu"
    devices_per_node: int = 2
    nodes: int = 1
    steps: int = 8
    warmup_steps: int = 3
    timeout_s: float = 900.0
    memory_budget_gib: Optional[float] = None
    learning_rate: float = 1e-3
    lr_warmup_steps: int = 0  # linear warm-up of the learning rate (not the measurement's warmup_steps) ...
    lr_min_ratio: float = 1.0  # ... then cosine decay to this share of the peak at the last step (1.0: constant)
    loss_tolerance: float = 1e-3  # the report's bound on the relative loss gap between strategies of one model
    activation_checkpointing: bool = False
    data: dict[str, Any] = field(default_factory=dict)
    deepspeed_config: dict[str, Any] = field(default_factory=dict)
    launcher: Optional[tuple[str, ...]] = None
    env: dict[str, str] = field(default_factory=dict)
    models: dict[str, InlineModel] = field(default_factory=dict)
    description: str = ""

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def measured_steps(self) -> int:
        return self.steps - self.warmup_steps

    def fingerprint(self) -> str:
        """A hash of every setting that changes what a cell measures: results of another fingerprint are not mixed."""
        relevant = {key: value for key, value in asdict(self).items() if key not in ("name", "description", "grid")}
        relevant.pop("timeout_s")
        relevant.pop("memory_budget_gib")
        relevant.pop("loss_tolerance")  # a verdict of the report, not a setting of the training
        return hashlib.sha256(json.dumps(relevant, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_study_config(path: str | Path) -> StudyConfig:
    """Read and validate a study YAML file."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise StudyConfigError(f"--config {str(path)!r}: no such file. Give a study YAML such as configs/study/*.yaml.")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise StudyConfigError(f"{path} is not valid YAML: {err}") from err
    return parse_study_config(raw, default_name=path.stem)


def parse_study_config(raw: Any, default_name: str = "study") -> StudyConfig:
    """Validate the parsed YAML (a mapping) and build the :class:`StudyConfig`."""
    if not isinstance(raw, dict):
        raise StudyConfigError(f"A study config is a mapping of settings; this one holds a {type(raw).__name__}.")
    _refuse_unknown(raw, TOP_LEVEL_KEYS, "the study config")
    models = _inline_models(raw.get("models") or {})
    config = StudyConfig(
        name=str(raw.get("name", default_name)),
        description=str(raw.get("description", "")),
        grid=_grid(raw.get("grid")),
        accelerator=_choice(raw.get("accelerator", "cpu"), ACCELERATORS, "accelerator"),
        devices_per_node=_positive_int(raw.get("devices_per_node", 2), "devices_per_node"),
        nodes=_positive_int(raw.get("nodes", 1), "nodes"),
        steps=_positive_int(raw.get("steps", 8), "steps"),
        warmup_steps=_positive_int(raw.get("warmup_steps", 3), "warmup_steps"),
        timeout_s=_positive_number(raw.get("timeout_s", 900), "timeout_s"),
        memory_budget_gib=_optional_positive(raw.get("memory_budget_gib"), "memory_budget_gib"),
        learning_rate=_positive_number(raw.get("learning_rate", 1e-3), "learning_rate"),
        lr_warmup_steps=_whole_number(raw.get("lr_warmup_steps", 0), "lr_warmup_steps"),
        lr_min_ratio=_positive_number(raw.get("lr_min_ratio", 1.0), "lr_min_ratio"),
        loss_tolerance=_positive_number(raw.get("loss_tolerance", 1e-3), "loss_tolerance"),
        activation_checkpointing=_flag(raw.get("activation_checkpointing", False), "activation_checkpointing"),
        data=_data(raw.get("data") or {}),
        deepspeed_config=_mapping(raw.get("deepspeed_config") or {}, "deepspeed_config"),
        launcher=_launcher(raw.get("launcher")),
        env={str(k): str(v) for k, v in _mapping(raw.get("env") or {}, "env").items()},
        models=models,
    )
    _check_consistency(config)
    return config


# ------------------------------------------------------------------------------------------------- sections
def _grid(raw: Any) -> StudyGrid:
    if not isinstance(raw, dict):
        raise StudyConfigError(
            "The study config needs a `grid:` mapping with at least `models`, `strategies` and `micro_batch_sizes`."
        )
    _refuse_unknown(raw, GRID_KEYS, "grid")
    return StudyGrid(
        models=tuple(str(m) for m in _axis(raw, "models")),
        strategies=tuple(str(s) for s in _axis(raw, "strategies")),
        micro_batch_sizes=tuple(_positive_int(m, "grid.micro_batch_sizes") for m in _axis(raw, "micro_batch_sizes")),
        hpz_partition_sizes=tuple(
            _positive_int(h, "grid.hpz_partition_sizes") for h in _axis(raw, "hpz_partition_sizes", required=False)
        ),
        precisions=tuple(
            _choice(p, PRECISIONS, "grid.precisions") for p in (_axis(raw, "precisions", required=False) or ["32-true"])
        ),
    )


def _axis(raw: dict[str, Any], key: str, required: bool = True) -> list[Any]:
    values = raw.get(key)
    if values is None and not required:
        return []
    if not isinstance(values, list) or not values:
        raise StudyConfigError(
            f"grid.{key} must be a non-empty list (got {values!r}); every grid axis needs at least one value."
        )
    if len(set(map(str, values))) != len(values):
        raise StudyConfigError(f"grid.{key} lists a value twice: {values}. Give each value once.")
    return values


def _inline_models(raw: Any) -> dict[str, InlineModel]:
    from lightning_hpz.models.architectures import FAMILIES
    from lightning_hpz.models.presets import PRESETS

    models = {}
    for name, definition in _mapping(raw, "models").items():
        if name in PRESETS:
            raise StudyConfigError(f"models.{name}: a preset has that name; give the study's own model a new name.")
        definition = _mapping(definition, f"models.{name}")
        _refuse_unknown(definition, MODEL_KEYS, f"models.{name}")
        family = _choice(definition.get("family"), FAMILIES, f"models.{name}.family")
        config = _mapping(definition.get("config"), f"models.{name}.config")
        models[name] = InlineModel(name, family, copy.deepcopy(config), definition.get("scaled_from"))
    return models


def _data(raw: Any) -> dict[str, Any]:
    data = _mapping(raw, "data")
    _refuse_unknown(data, DATA_KEYS, "data")
    data = {"source": "default", "tokenizer": "byte", "sequence_length": 64, **data}
    data["sequence_length"] = _positive_int(data["sequence_length"], "data.sequence_length")
    return data


def _launcher(raw: Any) -> Optional[tuple[str, ...]]:
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(isinstance(part, str) for part in raw):
        raise StudyConfigError(f"launcher must be a list of strings (a command), got {raw!r}.")
    if SPEC_PLACEHOLDER not in raw:
        raise StudyConfigError(
            f"launcher {raw} has no {SPEC_PLACEHOLDER!r} item: the cell's spec file is passed there, e.g. "
            "[srun, python, -m, lightning_hpz.study.worker, '{spec}']."
        )
    return tuple(raw)


# ------------------------------------------------------------------------------------------------- cross-checks
def _check_consistency(config: StudyConfig) -> None:
    if config.warmup_steps + 2 > config.steps:
        raise StudyConfigError(
            f"steps={config.steps} with warmup_steps={config.warmup_steps} leaves {config.measured_steps} measured "
            "steps; the step-time spread needs at least 2. Raise steps or lower warmup_steps."
        )
    if config.lr_warmup_steps >= config.steps:
        raise StudyConfigError(
            f"lr_warmup_steps={config.lr_warmup_steps} is not below steps={config.steps}: the learning rate would "
            "never reach its peak. Lower lr_warmup_steps (0 for none) or raise steps."
        )
    if config.lr_min_ratio > 1:
        raise StudyConfigError(
            f"lr_min_ratio={config.lr_min_ratio}: the final learning rate is a share of the peak, in (0, 1]; "
            "1.0 keeps it constant after the warm-up."
        )
    if config.nodes > 1 and config.launcher is None:
        raise StudyConfigError(
            f"nodes={config.nodes}: a multi-node cell needs a `launcher:` that starts one process per rank on every "
            "node, e.g. [srun, python, -m, lightning_hpz.study.worker, '{spec}'] inside a SLURM allocation."
        )
    _check_models(config)
    _check_strategies(config)
    if config.accelerator == "cpu" and "16-mixed" in config.grid.precisions:
        raise StudyConfigError("precision 16-mixed needs a GPU (DeepSpeed's CPU accelerator has no fp16); use 32-true.")


def _check_models(config: StudyConfig) -> None:
    from lightning_hpz.models.presets import PRESETS

    unknown = [m for m in config.grid.models if m not in PRESETS and m not in config.models]
    if unknown:
        raise StudyConfigError(
            f"grid.models: unknown model(s) {unknown}. Use a preset ({', '.join(PRESETS)}) or define the model "
            "under `models:` (family + config)."
        )


def _check_strategies(config: StudyConfig) -> None:
    from lightning_hpz.study.cell_strategy import strategy_names, uses_hpz

    known = strategy_names()
    unknown = [s for s in config.grid.strategies if s not in known]
    if unknown:
        raise StudyConfigError(f"grid.strategies: unknown strategy {unknown}. Registered names: {', '.join(known)}.")
    if config.accelerator == "cpu" and "zeropp" in config.grid.strategies:
        raise StudyConfigError("grid.strategies: zeropp quantizes with CUDA kernels only; drop it on accelerator cpu.")
    hpz_strategies = [s for s in config.grid.strategies if uses_hpz(s)]
    sizes = config.grid.hpz_partition_sizes
    if sizes and not hpz_strategies:
        raise StudyConfigError(
            f"grid.hpz_partition_sizes={list(sizes)} but no strategy in the grid uses hpZ; add hpz (or hpz_offload), "
            "or drop hpz_partition_sizes."
        )
    if hpz_strategies and not sizes and config.nodes == 1:
        raise StudyConfigError(
            f"{hpz_strategies} on one node: hpz_partition_size 'auto' turns hpZ off there, so those cells would be "
            "plain ZeRO-3. Give grid.hpz_partition_sizes (divisors of devices_per_node, e.g. [2])."
        )
    bad = [h for h in sizes if h < 2 or config.devices_per_node % h]
    if bad:
        raise StudyConfigError(
            f"grid.hpz_partition_sizes {bad}: each must be at least 2 and divide devices_per_node="
            f"{config.devices_per_node}, so that a secondary group stays inside one node."
        )


# ------------------------------------------------------------------------------------------------- scalars
def _refuse_unknown(raw: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise StudyConfigError(f"Unknown key(s) {unknown} in {where}. Known keys: {', '.join(known)}.")


def _mapping(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise StudyConfigError(f"{name} must be a mapping, got {value!r}.")
    return value


def _choice(value: Any, choices: tuple[str, ...], name: str) -> str:
    if value not in choices:
        raise StudyConfigError(f"{name}={value!r} is not one of {', '.join(choices)}.")
    return value


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise StudyConfigError(f"{name}={value!r} must be true or false.")
    return value


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise StudyConfigError(f"{name}={value!r} must be a positive whole number.")
    return value


def _whole_number(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise StudyConfigError(f"{name}={value!r} must be a whole number, 0 or more.")
    return value


def _positive_number(value: Any, name: str) -> float:
    if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
        with contextlib.suppress(ValueError):
            value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise StudyConfigError(f"{name}={value!r} must be a positive number.")
    return float(value)


def _optional_positive(value: Any, name: str) -> Optional[float]:
    return None if value is None else _positive_number(value, name)
