"""``Autotuner``: one strategy's tuning, from the probe to the ``zero_optimization`` keys it fills in.

The strategy calls it at three points:

1. :meth:`Autotuner.start`, once the process group exists: re-use the decision recorded in the checkpoint being
   resumed (unless told to re-tune), or probe the links.
2. :meth:`Autotuner.decide_structure`, when ``zero.Init`` is about to convert parameters (``configure_model`` under
   ZeRO-3): the hpZ size and the persistence threshold shape the converted parameters, so they are fixed then, from
   the parameters that exist by that time.
3. :meth:`Autotuner.decide`, right before the DeepSpeed engine is built, with the whole model: the final decision.

The user's own values are never changed: the tuner only chooses what was left unset.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union

import torch

from lightning_hpz import collectives
from lightning_hpz.autotune.link_probe import probe_links
from lightning_hpz.planning.communication import ClusterLayout
from lightning_hpz.planning.tuning import (
    GIB,
    PERSISTENCE,
    THRESHOLD_KEYS,
    FixedSettings,
    LinkFigures,
    ModelFacts,
    TrainingFacts,
    candidates,
    choose,
)
from lightning_hpz.planning.tuning_decision import TuningDecision

AUTOTUNE_MODES = (False, True, "retune")
RECORD_KEY = "autotune"  # where a checkpoint's manifest keeps the decision (under "run")
_UNMEASURED = LinkFigures(intra_node_bytes_per_s=1.0, intra_node_latency_s=0.0)  # one process: no traffic


class Autotuner:
    """Chooses the hpZ size and ZeRO-3 thresholds the user left open (see the module docstring).

    Args:
        mode: ``True``: tune, or re-use the decision of a resumed checkpoint; ``"retune"``: always measure anew.
        memory_gib: memory budget per rank; default: the device's total memory (CPU: the host's, shared by its ranks).
        fixed: the hpZ size and thresholds the user set.
    """

    def __init__(self, mode: Union[bool, str], memory_gib: Optional[float], fixed: FixedSettings) -> None:
        if mode not in AUTOTUNE_MODES:
            raise ValueError(f"autotune={mode!r}: choose True, False or 'retune'.")
        if memory_gib is not None and memory_gib <= 0:
            raise ValueError(f"autotune_memory_gib={memory_gib}: give a positive number of GiB per rank.")
        self.mode = mode
        self.memory_gib = memory_gib
        self.fixed = fixed
        self.links: Optional[LinkFigures] = None
        self.decision: Optional[TuningDecision] = None
        self.structure: Optional[FixedSettings] = None  # hpZ size and persistence pinned by decide_structure

    # --------------------------------------------------------------------------------------------- start-up
    def start(self, layout: ClusterLayout, resumed_from: Optional[Union[str, Path]]) -> None:
        """Re-use a recorded decision or probe the links (a collective: every rank calls it)."""
        if self.decision is not None:  # a later validate/test/predict (or fit) with the same strategy: keep it
            return
        recorded = self._recorded_decision(resumed_from, layout) if self.mode is True else None
        if recorded is not None:
            self.decision = recorded
            rank_zero_info(recorded.table())
            return
        if layout.world_size > 1:
            self.links = probe_links(layout, collectives.rank())
        else:
            self.links = None

    def _recorded_decision(self, path: Optional[Union[str, Path]], layout: ClusterLayout) -> Optional[TuningDecision]:
        # Rank 0 reads, everyone gets its answer: all ranks then take the same branch (probe or not).
        record = collectives.broadcast_object(read_recorded_decision(path) if collectives.rank() == 0 else None)
        if record is None:
            return None
        decision = TuningDecision.from_dict(record, source="checkpoint")
        problem = self._reuse_problem(decision, layout)
        if problem:
            rank_zero_info(f"hpZ autotune: not re-using the checkpoint's choice ({problem}); measuring anew.")
            return None
        return decision

    def _reuse_problem(self, decision: TuningDecision, layout: ClusterLayout) -> str:
        if tuple(decision.layout) != (layout.nodes, layout.devices_per_node):
            return f"it was made for {decision.layout[0]} x {decision.layout[1]} devices"
        if self.fixed.hpz_partition_size not in (None, decision.hpz_partition_size):
            return f"hpz_partition_size={self.fixed.hpz_partition_size} is given"
        changed = [k for k, v in self.fixed.thresholds.items() if decision.zero_thresholds[k] != v]
        return f"{', '.join(changed)} given" if changed else ""

    # --------------------------------------------------------------------------------------------- decisions
    def decide_structure(self, module: torch.nn.Module, layout: ClusterLayout, config: dict[str, Any]) -> None:
        """Fix the hpZ size and persistence threshold before ``zero.Init`` converts parameters with them."""
        if self.decision is not None or self.structure is not None:
            return
        facts = model_facts(module)
        if facts.parameter_count == 0:  # nothing built yet: keep what the config has, tune the rest later
            section = config.get("zero_optimization", {})
            self._pin(section.get("zero_hpz_partition_size", 1), section.get(PERSISTENCE, 100_000))
            return
        early = self._choose(facts, layout, config, self.fixed)
        self._pin(early.hpz_partition_size, early.zero_thresholds[PERSISTENCE])

    def _pin(self, hpz: int, persistence: int) -> None:
        thresholds = {**self.fixed.thresholds, PERSISTENCE: int(persistence)}
        self.structure = FixedSettings(hpz_partition_size=int(hpz), thresholds=thresholds)

    def decide(self, module: torch.nn.Module, layout: ClusterLayout, config: dict[str, Any]) -> TuningDecision:
        """The final decision (re-used if already made), logged as one table on rank 0."""
        if self.decision is None:
            fixed = self.structure or self._fixed_by_conversion(module, config) or self.fixed
            self.decision = self._choose(model_facts(module), layout, config, fixed)
            rank_zero_info(self.decision.table())
        return self.decision

    def _fixed_by_conversion(self, module: torch.nn.Module, config: dict[str, Any]) -> Optional[FixedSettings]:
        # Parameters a zero.Init converted outside the strategy's own hooks carry the hpZ size it had then.
        if not any(hasattr(p, "ds_id") for p in module.parameters()):
            return None
        section = config.get("zero_optimization", {})
        self._pin(section.get("zero_hpz_partition_size", 1), section.get(PERSISTENCE, 100_000))
        return self.structure

    def _choose(
        self, facts: ModelFacts, layout: ClusterLayout, config: dict[str, Any], fixed: FixedSettings
    ) -> TuningDecision:
        budget = self.budget_bytes(layout)
        training = training_facts(config, facts.parameter_count)
        found = candidates(facts, layout, self.links or _UNMEASURED, training, fixed, budget)
        pick, reason = choose(found, budget)
        decision = TuningDecision.from_choice(
            pick, found, self.links, budget, reason, (layout.nodes, layout.devices_per_node)
        )
        # Every rank computed this from the same agreed figures; rank 0's copy makes agreement certain.
        return collectives.broadcast_object(decision)

    def budget_bytes(self, layout: ClusterLayout) -> float:
        if self.memory_gib is not None:
            return self.memory_gib * GIB
        return device_memory_bytes(layout.devices_per_node)


def rank_zero_info(message: str) -> None:
    # Imported here: importing Lightning registers this package's strategies, which import this module.
    from lightning.fabric.utilities.rank_zero import rank_zero_info as info

    info(message)


def model_facts(module: torch.nn.Module) -> ModelFacts:
    """Each module's own trainable parameters' element counts (the full count of ZeRO-3-converted ones)."""
    found = []
    for submodule in module.modules():
        numels = tuple(
            int(getattr(p, "ds_numel", p.numel())) for p in submodule.parameters(recurse=False) if p.requires_grad
        )
        if numels:
            found.append(numels)
    return ModelFacts(tuple(found))


def training_facts(config: dict[str, Any], parameter_count: int) -> TrainingFacts:
    """Bytes per value, optimizer placement and reduction kind from a DeepSpeed config and the process group."""
    half = any((config.get(key) or {}).get("enabled") for key in ("bf16", "fp16"))
    section = config.get("zero_optimization") or {}
    offloaded = (section.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")
    on_gloo = collectives.collective_device().type == "cpu"
    bucket = float(section.get("reduce_bucket_size", 0))
    # A GPU allocates ZeRO-3's whole reduce bucket; host memory holds only the pages gradients were written to.
    bucket = min(bucket, parameter_count) if on_gloo else bucket
    return TrainingFacts(
        param_bytes=2 if half else 4,
        grad_bytes=2 if half else 4,
        optimizer_bytes_per_param=0 if offloaded else 12,
        gradient_reduction="all_reduce" if on_gloo else "reduce_scatter",
        reduce_bucket_elements=bucket,
        quantized_weights=bool(section.get("zero_quantized_weights")),
        quantized_gradients=bool(section.get("zero_quantized_gradients")),
    )


def device_memory_bytes(ranks_per_node: int) -> float:
    """This rank's device memory; on CPU the host's physical memory shared by the node's ranks."""
    device = collectives.collective_device()
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(1, ranks_per_node)


def read_recorded_decision(path: Optional[Union[str, Path]]) -> Optional[dict[str, Any]]:
    """The decision a checkpoint directory's manifest records, or None (no path, a file, no record)."""
    from lightning_hpz.checkpointing import manifest

    if path is None or not Path(path).is_dir():
        return None
    record = manifest.read_manifest(Path(path)) or {}
    return (record.get("run") or {}).get(RECORD_KEY)


def fixed_settings(hpz_partition_size: Any, user_config: dict[str, Any]) -> FixedSettings:
    """What the user set: an hpZ size other than ``"auto"``, and thresholds given in ``config``."""
    section = user_config.get("zero_optimization") or {}
    hpz = section.get("zero_hpz_partition_size", hpz_partition_size)
    given = {k: int(section[k]) for k in THRESHOLD_KEYS if k in section}
    return FixedSettings(hpz_partition_size=None if hpz in (None, "auto") else int(hpz), thresholds=given)
