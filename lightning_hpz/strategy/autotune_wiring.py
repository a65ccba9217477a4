"""Where the autotuner (:mod:`lightning_hpz.autotune`) meets the strategy: when it measures, what its choice changes
in the DeepSpeed config, and the memory check after this run's first optimizer step.

The tuner itself knows nothing of Lightning; this mixin only calls it at the right moments: once the process group
exists (``_start_autotune``), before ``zero.Init`` converts parameters (``_tune_structure``), before the engine is
built (``_tune_engine``), and at teardown.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_hpz.autotune.memory_check import MemoryCheck, check_memory
from lightning_hpz.autotune.tuner import Autotuner, fixed_settings
from lightning_hpz.planning.communication import ClusterLayout
from lightning_hpz.planning.tuning_decision import TuningDecision
from lightning_hpz.strategy import config as cfg


class AutotuneWiring:
    """Mixin of :class:`~lightning_hpz.strategy.hpz_setup.HpzSetup`: the autotuner's moments in a run.

    Reads ``_autotuner`` (None without ``autotune``), ``autotune_checkpoint`` and ``config``; sets
    ``hpz_partition_size`` when the tuner chooses it, and ``autotune_memory_check`` after the first step.
    """

    _autotuner: Optional[Autotuner]
    autotune_checkpoint: Union[str, Path, None]
    autotune_memory_check: Optional[MemoryCheck]
    _memory_check_pending: bool
    _optimizer_stepped: bool

    @property
    def autotune_decision(self) -> Optional[TuningDecision]:
        """What the autotuner chose (None without ``autotune``, or before the engine is built)."""
        return self._autotuner.decision if self._autotuner is not None else None

    def _layout(self) -> ClusterLayout:
        return ClusterLayout(self.num_nodes, self.devices_per_node)

    def _autotune_resume_path(self) -> Union[str, Path, None]:
        return self.autotune_checkpoint

    def _autotune_wanted(self) -> bool:
        """Whether this run builds a training engine (the Trainer's validate/test/predict do not)."""
        return True

    def _start_autotune(self) -> None:
        """Once the process group exists: measure, or re-use the choice recorded in the checkpoint resumed."""
        if self._autotuner is None or not self._autotune_wanted():
            return
        self._autotuner.start(self._layout(), self._autotune_resume_path())
        if self._autotuner.decision is not None:  # re-used from the checkpoint: known before anything is built
            self._apply_autotune(self._autotuner.decision)

    def _end_autotune(self) -> None:
        if self._autotuner is not None:
            self._autotuner.end_of_run()

    def _tune_structure(self, module: Optional[torch.nn.Module]) -> None:
        """Before a ``zero.Init`` converts parameters: fix the hpZ size they are made with."""
        if self._autotuner is None or not self._autotune_wanted():
            return
        size = self._autotuner.decide_structure(module or torch.nn.Module(), self._layout(), self.config)
        self._apply_zero_keys({"zero_hpz_partition_size": size})

    def _tune_engine(self, model: torch.nn.Module) -> None:
        """Before ``deepspeed.initialize``: the thresholds (and the hpZ size, if still open) for this model."""
        if self._autotuner is not None:
            self._apply_autotune(self._autotuner.decide(model, self._layout(), self.config))

    def _training_engine_built(self) -> None:
        self._memory_check_pending = self.autotune_decision is not None
        self._optimizer_stepped = False

    def _apply_autotune(self, decision: TuningDecision) -> None:
        self._apply_zero_keys(decision.zero_section(spelled_as=self.config.get("zero_optimization")))

    def _apply_zero_keys(self, keys: dict[str, Any]) -> None:
        size = int(keys.get("zero_hpz_partition_size", self.hpz_partition_size or 1))
        cfg.validate_layout(size, self.devices_per_node, self.num_nodes)
        cfg.validate_hpz_companions(self.config, size)
        self.config.setdefault("zero_optimization", {}).update(keys)
        changed = size != (self.hpz_partition_size or 1)
        self.hpz_partition_size = size
        if changed:
            self._check_secondary_groups_within_nodes()

    def _note_optimizer_step(self) -> None:
        """Call after every optimizer step of the strategy: the memory check waits for this run's first one."""
        self._optimizer_stepped = True

    def _check_memory_if_due(self) -> None:
        """Once per engine, at the first step after this run's first optimizer step: the peak against the budget."""
        if not (self._memory_check_pending and self._optimizer_stepped and self.autotune_decision is not None):
            return
        self._memory_check_pending = False
        # A collective: every rank reaches its first step after an optimizer step together.
        self.autotune_memory_check = check = check_memory(self.autotune_decision, self.root_device)
        (rank_zero_info if check.within_budget else rank_zero_warn)(check.message())


def build_autotuner(
    mode: Union[bool, str], memory_gib: Optional[float], settings: Any, hpz_partition_size: Any, user_config: dict
) -> Optional[Autotuner]:
    """The tuner ``autotune=mode`` asks for, or None; refused below stage 3 or with unusable settings."""
    if mode is False:
        return None
    if settings.stage != 3:
        raise cfg.HpzConfigurationError(
            f"autotune={mode!r} chooses the hpZ size and ZeRO-3's thresholds, so it needs stage=3 (stage="
            f"{settings.stage}). Use stage=3, or autotune=False."
        )
    try:
        return Autotuner(mode, memory_gib, fixed_settings(hpz_partition_size, user_config))
    except ValueError as err:
        raise cfg.HpzConfigurationError(str(err)) from err
