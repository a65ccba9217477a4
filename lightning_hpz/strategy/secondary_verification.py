"""Keeping hpZ's secondary partitions true to their primaries: refreshed whenever the weights change outside an
optimizer step, and checked at the next step when the strategy was asked to verify.

A secondary copy outlives the weights it was made from when weights are written behind DeepSpeed's back: a
checkpoint or state-dict load, ``configure_model``, a user's ``load_state_dict`` under ``GatheredParameters``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from lightning_hpz import partitioning


class SecondaryVerification:
    """Mixin of :class:`~lightning_hpz.strategy.hpz_setup.HpzSetup`: refresh and check secondary partitions.

    Reads ``verify_after_load`` and ``hpz_partition_size``; keeps ``secondary_checks_run`` (how many checks ran).
    The concrete strategy says which module holds the parameters (:meth:`_hpz_module`).
    """

    verify_after_load: bool
    secondary_checks_run: int
    _verify_at_next_step: bool
    _load_hook_modules: weakref.WeakSet[torch.nn.Module]

    def _hpz_module(self) -> torch.nn.Module:
        """The user's model whose secondary partitions the strategy checks and refreshes."""
        raise NotImplementedError

    def refresh_secondary_partitions(self) -> int:
        """Drop every secondary partition so the next gather rebuilds them from the primary shards."""
        return partitioning.refresh_secondary_partitions(self._hpz_module())

    def check_secondary_partitions(self, raise_on_mismatch: bool = True) -> partitioning.SecondaryCheckReport:
        """Compare every secondary partition with its primaries on all ranks (a collective)."""
        self.secondary_checks_run += 1
        return partitioning.check_secondary_partitions(self._hpz_module(), raise_on_mismatch=raise_on_mismatch)

    def _after_weights_changed(self) -> None:
        if self.zero_stage_3 and (self.hpz_partition_size or 1) > 1:
            self.refresh_secondary_partitions()
            self._verify_at_next_step = self.verify_after_load

    def _verify_if_due(self) -> None:
        """Call between forward and backward: forward has just rebuilt the secondaries that backward will read."""
        if self._verify_at_next_step:
            self._verify_at_next_step = False
            self.check_secondary_partitions()

    def _watch_load_state_dict(self, module: torch.nn.Module) -> None:
        # A user's `load_state_dict` into the sharded model (inside GatheredParameters, often on one rank only) must
        # not leave stale copies: drop those of the gathered parameters, their release rebuilds them on every rank.
        if module not in self._load_hook_modules:
            module.register_load_state_dict_post_hook(_drop_secondaries_of_gathered_parameters)
            self._load_hook_modules.add(module)


def _drop_secondaries_of_gathered_parameters(module: torch.nn.Module, incompatible_keys: Any) -> None:
    partitioning.refresh_secondary_partitions(module, gathered_only=True)
