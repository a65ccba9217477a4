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
    FIELD_NAMES,
    GIB,
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
NOMINAL_PARAMETERS = 1_000_000_000  # model size assumed for the hpZ choice before any parameter exists
RECORD_KEY = "autotune"  # where a checkpoint's manifest keeps the decision (under "run")
_UNMEASURED = LinkFigures(intra_node_bytes_per_s=1.0, intra_node_latency_s=0.0)  # one process: no traffic


class Autotuner:
    """Chooses the hpZ size and ZeRO-3 thresholds the user left open (see the module docstring).

    Args:
        mode: ``True``: tune, or re-use the decision of a resumed checkpoint; ``"retune"``: always measure anew.
        memory_gib: memory budget per rank; default: the device's free memory (CPU: the host's, shared by its ranks).
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
        self.pinned_hpz: Optional[int] = None  # fixed by decide_structure, before zero.Init converted parameters

    # --------------------------------------------------------------------------------------------- start-up
    def start(self, layout: ClusterLayout, resumed_from: Optional[Union[str, Path]]) -> None:
        """Re-use a recorded decision or probe the links (a collective: every rank calls it)."""
        if self.decision is not None or self.links is not None:  # a later fit with the same strategy
            return
        recorded = self._recorded_decision(resumed_from, layout) if self.mode is True else None
        if recorded is not None:
            self.decision = recorded
            rank_zero_info(recorded.table())
            return
        self.links = probe_links(layout, collectives.rank()) if layout.world_size > 1 else None

    def end_of_run(self) -> None:
        """Forget what only held for the run that ended (a pinned hpZ size); the measurements stay."""
        self.pinned_hpz = None

    def _recorded_decision(self, path: Optional[Union[str, Path]], layout: ClusterLayout) -> Optional[TuningDecision]:
        # Rank 0 reads and everyone gets its answer (or its reason not to use it): all ranks take the same branch.
        found: tuple[Optional[TuningDecision], str] = (None, "")
        if collectives.rank() == 0:
            found = _read_decision(path)
        decision, problem = collectives.broadcast_object(found)
        problem = problem or (self._reuse_problem(decision, layout) if decision is not None else "")
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
        if changed:
            return f"{', '.join(changed)} given"
        budget_gib = self.budget_bytes(layout) / GIB
        if abs(budget_gib - decision.memory_budget_gib) > 0.01 * decision.memory_budget_gib:
            return f"the memory budget is {budget_gib:.2f} GiB, it was {decision.memory_budget_gib:.2f} GiB"
        return ""

    # --------------------------------------------------------------------------------------------- decisions
    def decide_structure(self, module: torch.nn.Module, layout: ClusterLayout, config: dict[str, Any]) -> int:
        """The hpZ size, fixed before ``zero.Init`` converts parameters with it (it builds hpZ groups per parameter).

        From the parameters that exist by then; when none do (``configure_model``, ``fabric.init_module``), from the
        link figures for a model of ``NOMINAL_PARAMETERS``, whose size hardly matters: the bytes of every candidate
        scale with it alike. Memory is checked when the engine is built, with the whole model.
        """
        if self.decision is not None:
            return self.decision.hpz_partition_size
        if self.pinned_hpz is None:
            facts = model_facts(module)
            if facts.parameter_count == 0:
                facts = ModelFacts.approximate(NOMINAL_PARAMETERS)
            early = self._choose(facts, layout, config, self.fixed, budget=float("inf"))
            self.pinned_hpz = early.hpz_partition_size
        return self.pinned_hpz

    def decide(self, module: torch.nn.Module, layout: ClusterLayout, config: dict[str, Any]) -> TuningDecision:
        """The final decision, logged as one table on rank 0; re-used while the model is the same."""
        facts = model_facts(module)
        if self.decision is not None and self.decision.parameter_count in (0, facts.parameter_count):
            return self.decision
        fixed = self.fixed
        hpz = self.pinned_hpz if self.pinned_hpz is not None else _hpz_of_converted(module, config)
        if hpz is not None:
            fixed = FixedSettings(hpz_partition_size=hpz, thresholds=self.fixed.thresholds)
        self.decision = self._choose(facts, layout, config, fixed)
        rank_zero_info(self.decision.table())
        return self.decision

    def _choose(
        self,
        facts: ModelFacts,
        layout: ClusterLayout,
        config: dict[str, Any],
        fixed: FixedSettings,
        budget: Optional[float] = None,
    ) -> TuningDecision:
        budget = self.budget_bytes(layout) if budget is None else budget
        training = training_facts(config, facts.trainable_count)
        found = candidates(facts, layout, self.links or _UNMEASURED, training, fixed, budget)
        pick, reason = choose(found, budget)
        return TuningDecision.from_choice(
            pick, found, self.links, budget, reason, (layout.nodes, layout.devices_per_node), facts.parameter_count
        )

    def budget_bytes(self, layout: ClusterLayout) -> float:
        """The smallest budget of all ranks (a collective), so that every rank chooses from the same numbers."""
        own = self.memory_gib * GIB if self.memory_gib is not None else device_memory_bytes(layout.devices_per_node)
        return collectives.all_reduce_values([own], op="min")[0]


def _hpz_of_converted(module: torch.nn.Module, config: dict[str, Any]) -> Optional[int]:
    """The hpZ size parameters converted by a zero.Init outside the strategy's hooks were built with, if any."""
    if not any(hasattr(p, "ds_id") for p in module.parameters()):
        return None
    return int(config.get("zero_optimization", {}).get("zero_hpz_partition_size", 1))


def _read_decision(path: Optional[Union[str, Path]]) -> tuple[Optional[TuningDecision], str]:
    try:
        record = read_recorded_decision(path)
        return (TuningDecision.from_dict(record, source="checkpoint") if record else None), ""
    except (OSError, ValueError, KeyError, TypeError) as err:  # unreadable: measure instead of failing the run
        return None, f"its record in {path} is unreadable: {err}"


def rank_zero_info(message: str) -> None:
    # Imported here: importing Lightning registers this package's strategies, which import this module.
    from lightning.fabric.utilities.rank_zero import rank_zero_info as info

    info(message)


def model_facts(module: torch.nn.Module) -> ModelFacts:
    """Each module's own parameters' element counts (the full count of ZeRO-3-converted ones), frozen ones included:
    ZeRO-3 shards and gathers those too; only the trainable ones have gradients and optimizer states."""
    found, trainable = [], 0
    for submodule in module.modules():
        own = list(submodule.parameters(recurse=False))
        if own:
            found.append(tuple(_full_numel(p) for p in own))
            trainable += sum(_full_numel(p) for p in own if p.requires_grad)
    return ModelFacts(tuple(found), trainable_elements=trainable)


def _full_numel(parameter: torch.nn.Parameter) -> int:
    return int(getattr(parameter, "ds_numel", parameter.numel()))


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
    """This rank's free device memory; on CPU the host's physical memory shared by the node's ranks."""
    device = collectives.collective_device()
    if device.type == "cuda":  # free now: the CUDA context, NCCL's buffers and other processes are already taken
        torch.cuda.empty_cache()
        return float(torch.cuda.mem_get_info(device)[0])
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
    given = {k: int(section[name]) for k in THRESHOLD_KEYS for name in (k, FIELD_NAMES[k]) if name in section}
    return FixedSettings(hpz_partition_size=None if hpz in (None, "auto") else int(hpz), thresholds=given)
