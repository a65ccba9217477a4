"""The autotuner's choice: hpZ size and ZeRO-3 thresholds from measured links, the model's shapes and a memory budget.

Torch-free and deterministic: the same inputs give the same choice on every rank, so ranks that agree on the link
figures apply the same configuration. The model behind the predictions:

* Communication per step (one micro-batch) is the ring traffic of :mod:`lightning_hpz.planning.communication`: the
  forward all-gather over the world, the backward all-gather over the hpZ group (the world without hpZ) of the part of
  the model that was released after forward, and the gradient reduction over the world. Bytes cost the measured
  bandwidth (a node's cross-node bytes share its link); each all-gather of a module costs the measured latency.
* How much of the model stays gathered from forward to backward: DeepSpeed releases a module's parameters after it
  ran unless they are used again within ``stage3_max_reuse_distance`` parameter elements of the recorded module
  order, or were already prefetched for a later use (``PartitionedParameterCoordinator.__params_to_release``). In
  backward the parameters used last in forward come first, at a reuse distance of about twice the elements after
  them; at the turn from forward to backward, parameters the prefetcher claimed stay too. Measured on DeepSpeed 0.19.8
  (8 equal layers, ``tests/test_autotune_retention.py`` and docs/autotune.md): with a prefetch bucket of one module
  the retained share is ``max(reuse / 2, 2 * prefetch) / params``; ``stage3_max_live_parameters`` only caps
  prefetching. Larger buckets keep more than that (two modules' bucket kept six of eight layers at any reuse distance
  below twice the model), so the profiles prefetch one module ahead, where the rule holds.
* Memory per rank: the ZeRO-3 model states of :mod:`lightning_hpz.planning.memory`, plus the retained gathered
  parameters, hpZ's secondary shards of the released part, full copies of persistent parameters, and one module plus
  the prefetch bucket in flight. A candidate fits when that is at most ``1 - MEMORY_HEADROOM`` of the budget; the
  rest is left for activations, temporaries and allocator fragmentation, which this model does not predict.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from lightning_hpz.planning.communication import (
    ClusterLayout,
    TrafficEstimate,
    ZeroSetup,
    cross_node_link_share,
    hierarchical_gradient_all_to_all,
    quantized_bytes,
    ring_traffic,
)
from lightning_hpz.planning.memory import memory_per_rank

LIVE, REUSE, PREFETCH, PERSISTENCE = (
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
)
THRESHOLD_KEYS = (LIVE, REUSE, PREFETCH, PERSISTENCE)
# DeepSpeed's config accepts each key also under its field name; a user's value may come under either.
FIELD_NAMES = {
    LIVE: "max_live_parameters",
    REUSE: "max_reuse_distance",
    PREFETCH: "prefetch_bucket_size",
    PERSISTENCE: "param_persistence_threshold",
}
DEEPSPEED_DEFAULTS = {LIVE: 1_000_000_000, REUSE: 1_000_000_000, PREFETCH: 50_000_000, PERSISTENCE: 100_000}
MEMORY_HEADROOM = 0.2  # share of the budget kept free for activations, temporaries and fragmentation
NEAR_TIE = 0.005  # predictions this close to the fastest count as equally fast; the least memory wins among them
PERSISTENT_SHARE = 0.01  # small parameters kept whole on every rank may hold at most this share of the model
# Retention profiles: the share of the model kept gathered from forward to backward.
RETENTION_PROFILES = {"release": 0.0, "half": 0.5, "keep": 1.0}
GIB = 2**30


class NoCandidateFitsError(ValueError):
    """Every candidate's predicted memory exceeds the budget."""


@dataclass(frozen=True)
class LinkFigures:
    """Measured all-gather figures: per-rank bandwidth and latency inside a node, per-node bandwidth and latency
    between nodes (``inter_*`` are ``None`` on one node)."""

    intra_node_bytes_per_s: float
    intra_node_latency_s: float
    inter_node_bytes_per_s: Optional[float] = None
    inter_node_latency_s: Optional[float] = None
    probe_seconds: float = 0.0

    def to_dict(self) -> dict[str, Optional[float]]:
        gbps = lambda rate: None if rate is None else rate * 8 / 1e9  # noqa: E731
        micro = lambda seconds: None if seconds is None else seconds * 1e6  # noqa: E731
        return {
            "intra_node_gbps": gbps(self.intra_node_bytes_per_s),
            "intra_node_latency_us": micro(self.intra_node_latency_s),
            "inter_node_gbps": gbps(self.inter_node_bytes_per_s),
            "inter_node_latency_us": micro(self.inter_node_latency_s),
            "probe_seconds": self.probe_seconds,
        }


@dataclass(frozen=True)
class ModelFacts:
    """The shapes the planner needs: the element counts of each module's own parameters, in order (frozen ones too:
    ZeRO-3 shards and gathers them like the others), and how many elements are trained (gradients, optimizer)."""

    module_parameters: tuple[tuple[int, ...], ...]
    trainable_elements: Optional[int] = None  # None: all of them

    @property
    def parameter_count(self) -> int:
        return sum(sum(numels) for numels in self.module_parameters)

    @property
    def trainable_count(self) -> int:
        return self.parameter_count if self.trainable_elements is None else self.trainable_elements

    def persistent_elements(self, threshold: int) -> int:
        return sum(n for numels in self.module_parameters for n in numels if n <= threshold)

    def gathered_modules(self, threshold: int) -> int:
        """Modules that own at least one parameter above the persistence threshold: one all-gather each."""
        return sum(any(n > threshold for n in numels) for numels in self.module_parameters)

    def largest_module(self) -> int:
        return max((sum(numels) for numels in self.module_parameters), default=0)

    @classmethod
    def approximate(cls, parameter_count: int, modules: int = 100) -> ModelFacts:
        """Equal modules, for ``lightning-hpz plan`` where only a parameter count is known."""
        size = max(1, parameter_count // modules)
        return cls(tuple((size,) for _ in range(modules)))


@dataclass(frozen=True)
class TrainingFacts:
    """What the run is: bytes per gathered parameter and gradient, optimizer bytes on the device, reduction kind."""

    param_bytes: int = 2
    grad_bytes: int = 2
    optimizer_bytes_per_param: int = 12  # 0 when the optimizer states are offloaded
    gradient_reduction: str = "reduce_scatter"  # "all_reduce" on gloo (see communication.py)
    reduce_bucket_elements: float = 0.0
    quantized_weights: bool = False
    quantized_gradients: bool = False


@dataclass(frozen=True)
class FixedSettings:
    """What the user set and the tuner must keep: an hpZ size and any of the four thresholds."""

    hpz_partition_size: Optional[int] = None
    thresholds: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Candidate:
    name: str
    hpz_partition_size: int
    zero_thresholds: dict[str, int]
    predicted_comm_s: float
    predicted_memory_bytes: float
    fits: bool

    def to_dict(self) -> dict[str, Any]:
        entry = asdict(self)
        entry["predicted_memory_gib"] = entry.pop("predicted_memory_bytes") / GIB
        return entry


def retained_fraction(thresholds: dict[str, int], parameter_count: int) -> float:
    """Share of the model DeepSpeed keeps gathered from forward to backward under these thresholds."""
    if parameter_count <= 0:
        return 1.0
    kept = max(thresholds[REUSE] / 2, 2 * min(thresholds[PREFETCH], thresholds[LIVE]))
    return max(0.0, min(1.0, kept / parameter_count))


def persistence_threshold(facts: ModelFacts) -> int:
    """The largest parameter size (at most DeepSpeed's default) whose parameters, that size and smaller, hold at most
    ``PERSISTENT_SHARE`` of the model: norms and biases stay whole instead of costing an all-gather each."""
    budget = PERSISTENT_SHARE * facts.parameter_count
    chosen, below = 0, 0
    for numel in sorted(n for numels in facts.module_parameters for n in numels):
        if numel > DEEPSPEED_DEFAULTS[PERSISTENCE] or below + numel > budget:
            break
        below += numel
        chosen = numel
    return chosen


def profile_thresholds(profile: str, facts: ModelFacts, persistence: int) -> dict[str, int]:
    """The four thresholds of a retention profile, sized to the model."""
    params = facts.parameter_count
    retained = RETENTION_PROFILES[profile]
    # One module ahead: overlap, and a retention DeepSpeed's release rule makes predictable (module docstring).
    prefetch = min(DEEPSPEED_DEFAULTS[PREFETCH], facts.largest_module())
    if retained >= 1.0:  # never release: above the model size whatever DeepSpeed's defaults are
        live, reuse = max(DEEPSPEED_DEFAULTS[LIVE], params), max(DEEPSPEED_DEFAULTS[REUSE], 2 * params)
    else:
        live, reuse = int(retained * params) + 2 * prefetch, int(2 * retained * params)
    return {LIVE: live, REUSE: reuse, PREFETCH: prefetch, PERSISTENCE: persistence}


def group_latency(group_size: int, layout: ClusterLayout, links: LinkFigures) -> float:
    """Latency of one ring all-gather over ``group_size`` consecutive ranks: one step per ring link, each link as
    fast as the probe measured its kind (a probe all-gather over ``g`` ranks takes ``g - 1`` steps)."""
    if group_size <= 1:
        return 0.0
    intra_step = links.intra_node_latency_s / max(1, layout.devices_per_node - 1)
    crossing = round(cross_node_link_share(group_size, layout) * group_size)
    if crossing == 0:
        return (group_size - 1) * intra_step
    inter_step = (links.inter_node_latency_s or 0.0) / max(1, layout.nodes - 1)
    return (group_size - crossing) * intra_step + crossing * inter_step


def link_seconds(traffic: TrafficEstimate, layout: ClusterLayout, links: LinkFigures) -> float:
    """Seconds to move ``traffic`` (per rank): a node's cross-node bytes over its link, a rank's intra-node bytes."""
    seconds = traffic.intra_node_bytes / links.intra_node_bytes_per_s
    if traffic.inter_node_bytes:
        if not links.inter_node_bytes_per_s:
            raise ValueError("cross-node traffic on a layout whose inter-node link was not measured")
        seconds += traffic.inter_node_bytes * layout.devices_per_node / links.inter_node_bytes_per_s
    return seconds


def predicted_comm_seconds(
    hpz: int,
    thresholds: dict[str, int],
    facts: ModelFacts,
    layout: ClusterLayout,
    links: LinkFigures,
    training: TrainingFacts,
) -> float:
    """Communication seconds per step if nothing overlaps (see the module docstring)."""
    world = layout.world_size
    params = facts.parameter_count
    sharded = params - facts.persistent_elements(thresholds[PERSISTENCE])
    released = 1.0 - retained_fraction(thresholds, params)
    forward_bytes = quantized_bytes(sharded, 8) if training.quantized_weights else sharded * training.param_bytes
    backward_group = hpz if hpz > 1 else world
    traffic = ring_traffic(forward_bytes, world, layout) + ring_traffic(
        sharded * training.param_bytes, backward_group, layout
    ).scaled(released)
    trained = facts.trainable_count
    if training.quantized_gradients:
        traffic = traffic + hierarchical_gradient_all_to_all(trained, layout)
    else:
        passes = 2 if training.gradient_reduction == "all_reduce" else 1
        traffic = traffic + ring_traffic(trained * training.grad_bytes, world, layout, passes=passes)
    gathers = facts.gathered_modules(thresholds[PERSISTENCE])
    latency = gathers * group_latency(world, layout, links) + gathers * released * group_latency(
        backward_group, layout, links
    )
    return link_seconds(traffic, layout, links) + latency


def predicted_memory_bytes(
    hpz: int, thresholds: dict[str, int], facts: ModelFacts, layout: ClusterLayout, training: TrainingFacts
) -> float:
    """Bytes one rank holds at the peak of a step (model states and gathered parameters; see the module docstring)."""
    params = facts.parameter_count
    persistent = facts.persistent_elements(thresholds[PERSISTENCE])
    sharded = params - persistent
    trained = memory_per_rank(
        facts.trainable_count,
        ZeroSetup(3),
        layout,
        training.param_bytes,
        training.optimizer_bytes_per_param,
        training.grad_bytes,
        training.reduce_bucket_elements,
    ).total
    frozen_shards = (params - facts.trainable_count) * training.param_bytes / layout.world_size
    states = trained + frozen_shards
    retained = retained_fraction(thresholds, params)
    secondary = (1.0 - retained) * sharded / hpz if hpz > 1 else 0.0
    in_flight = facts.largest_module() + thresholds[PREFETCH]
    gathered = retained * sharded + secondary + persistent + in_flight
    return states + gathered * training.param_bytes


def hpz_options(layout: ClusterLayout) -> list[int]:
    """hpZ off, and every divisor of the devices per node above 1 (on several nodes only: one node has no slow link)."""
    if layout.nodes == 1:
        return [1]
    return [1] + [d for d in range(2, layout.devices_per_node + 1) if layout.devices_per_node % d == 0]


def candidates(
    facts: ModelFacts,
    layout: ClusterLayout,
    links: LinkFigures,
    training: TrainingFacts,
    fixed: FixedSettings,
    budget_bytes: float,
) -> list[Candidate]:
    """Every combination of hpZ size and retention profile the user left open, with predictions."""
    sizes = [fixed.hpz_partition_size] if fixed.hpz_partition_size is not None else hpz_options(layout)
    persistence = fixed.thresholds.get(PERSISTENCE, persistence_threshold(facts))
    settings: dict[tuple[int, ...], tuple[str, dict[str, int]]] = {}
    for profile in RETENTION_PROFILES:
        thresholds = {**profile_thresholds(profile, facts, persistence), **fixed.thresholds}
        settings.setdefault(tuple(thresholds[k] for k in THRESHOLD_KEYS), (profile, thresholds))
    usable = budget_bytes * (1.0 - MEMORY_HEADROOM)
    found = []
    for hpz in sizes:
        for profile, thresholds in settings.values():
            memory = predicted_memory_bytes(hpz, thresholds, facts, layout, training)
            found.append(
                Candidate(
                    name=f"hpz{hpz}-{profile}" if not fixed.thresholds else f"hpz{hpz}-{profile}+fixed",
                    hpz_partition_size=hpz,
                    zero_thresholds=thresholds,
                    predicted_comm_s=predicted_comm_seconds(hpz, thresholds, facts, layout, links, training),
                    predicted_memory_bytes=memory,
                    fits=memory <= usable,
                )
            )
    return found


def choose(found: Sequence[Candidate], budget_bytes: float) -> tuple[Candidate, str]:
    """The fastest candidate that fits; among near-ties, the one needing least memory, then the smaller hpZ size."""
    fitting = [c for c in found if c.fits]
    if not fitting:
        least = min(found, key=lambda c: c.predicted_memory_bytes)
        raise NoCandidateFitsError(
            f"no hpZ/threshold setting fits the memory budget: the smallest ({least.name}) needs "
            f"{least.predicted_memory_bytes / GIB:.2f} GiB per rank, more than {1 - MEMORY_HEADROOM:.0%} of the "
            f"{budget_bytes / GIB:.2f} GiB budget. Give more memory (autotune_memory_gib), offload the optimizer "
            "(offload_optimizer=True), or train on more devices."
        )
    fastest = min(c.predicted_comm_s for c in fitting)
    near = [c for c in fitting if c.predicted_comm_s <= fastest * (1 + NEAR_TIE)]
    pick = min(near, key=lambda c: (c.predicted_memory_bytes, c.hpz_partition_size, c.name))
    why = (
        f"{pick.name}: predicted {pick.predicted_comm_s:.3g} s of communication per step "
        f"({'the fastest' if pick.predicted_comm_s == fastest else f'within {NEAR_TIE:.1%} of the fastest'} of "
        f"{len(fitting)} fitting candidates, {len(found) - len(fitting)} over the memory budget)"
    )
    if len(near) > 1:
        why += f"; least memory among {len(near)} near-ties"
    return pick, why
