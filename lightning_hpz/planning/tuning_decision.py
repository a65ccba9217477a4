"""What the autotuner decided, why, and from what: logged as one table, recorded in checkpoints, re-used on resume."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from lightning_hpz.planning.tuning import FIELD_NAMES, GIB, MEMORY_HEADROOM, THRESHOLD_KEYS, Candidate, LinkFigures

DECISION_FORMAT = 1


@dataclass(frozen=True)
class TuningDecision:
    """The chosen hpZ size and ZeRO-3 thresholds, the candidates compared and the link figures they came from."""

    hpz_partition_size: int
    zero_thresholds: dict[str, int]
    candidate: str
    links: Optional[dict[str, Any]]
    candidates: tuple[dict[str, Any], ...]
    memory_budget_gib: float
    reason: str
    source: str  # "probe": measured in this run; "checkpoint": re-used from the checkpoint resumed
    layout: tuple[int, int]  # (nodes, devices per node) the choice was made for
    parameter_count: int = 0  # of the model it was made for

    @classmethod
    def from_choice(
        cls,
        pick: Candidate,
        found: list[Candidate],
        links: Optional[LinkFigures],
        budget_bytes: float,
        reason: str,
        layout: tuple[int, int],
        parameter_count: int = 0,
    ) -> TuningDecision:
        return cls(
            hpz_partition_size=pick.hpz_partition_size,
            zero_thresholds={k: int(pick.zero_thresholds[k]) for k in THRESHOLD_KEYS},
            candidate=pick.name,
            links=links.to_dict() if links is not None else None,
            candidates=tuple(c.to_dict() for c in found),
            memory_budget_gib=budget_bytes / GIB,
            reason=reason,
            source="probe",
            layout=layout,
            parameter_count=parameter_count,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": DECISION_FORMAT,
            "hpz_partition_size": self.hpz_partition_size,
            "zero_thresholds": dict(self.zero_thresholds),
            "candidate": self.candidate,
            "links": self.links,
            "candidates": [dict(c) for c in self.candidates],
            "memory_budget_gib": self.memory_budget_gib,
            "reason": self.reason,
            "source": self.source,
            "layout": list(self.layout),
            "parameter_count": self.parameter_count,
        }

    @classmethod
    def from_dict(cls, record: dict[str, Any], source: str) -> TuningDecision:
        if record.get("format") != DECISION_FORMAT:
            raise ValueError(f"autotune record format {record.get('format')!r}, expected {DECISION_FORMAT}")
        return cls(
            hpz_partition_size=int(record["hpz_partition_size"]),
            zero_thresholds={k: int(record["zero_thresholds"][k]) for k in THRESHOLD_KEYS},
            candidate=str(record["candidate"]),
            links=record.get("links"),
            candidates=tuple(record.get("candidates", ())),
            memory_budget_gib=float(record["memory_budget_gib"]),
            reason=str(record["reason"]),
            source=source,
            layout=tuple(record["layout"]),  # type: ignore[arg-type]
            parameter_count=int(record.get("parameter_count", 0)),
        )

    def zero_section(self, spelled_as: Optional[dict[str, Any]] = None) -> dict[str, int]:
        """The ``zero_optimization`` keys this decision sets, each under the name ``spelled_as`` (a config section)
        already uses for it: DeepSpeed refuses a value given under both its key and its field name."""
        section = dict(spelled_as or {})
        keys = {k: (FIELD_NAMES[k] if FIELD_NAMES[k] in section else k) for k in THRESHOLD_KEYS}
        return {
            "zero_hpz_partition_size": self.hpz_partition_size,
            **{keys[k]: v for k, v in self.zero_thresholds.items()},
        }

    def table(self) -> str:
        """Candidates, predictions, the choice and why, as the log shows them."""
        lines = [self._heading(), self._links_line()]
        header = ["candidate", "hpZ", "live", "reuse", "prefetch", "persist", "comm s/step", "GiB/rank", "fits"]
        lines += [" | ".join(header), " | ".join("---" for _ in header)]
        for entry in self.candidates:
            t = entry["zero_thresholds"]
            mark = " <- chosen" if entry["name"] == self.candidate else ""
            cells = [
                entry["name"] + mark,
                str(entry["hpz_partition_size"]),
                *(f"{t[k]:.3g}" for k in THRESHOLD_KEYS),
                f"{entry['predicted_comm_s']:.4g}",
                f"{entry['predicted_memory_gib']:.3f}",
                "yes" if entry["fits"] else "no",
            ]
            lines.append(" | ".join(cells))
        lines.append(f"chosen: {self.reason}")
        return "\n".join(lines)

    def _heading(self) -> str:
        nodes, devices = self.layout
        origin = "re-used from the checkpoint" if self.source == "checkpoint" else "measured at start-up"
        return (
            f"hpZ autotune ({origin}), {nodes} node(s) x {devices} devices, memory budget "
            f"{self.memory_budget_gib:.2f} GiB/rank ({MEMORY_HEADROOM:.0%} kept free for activations):"
        )

    def _links_line(self) -> str:
        if not self.links:
            return "links: not measured (one process)"
        text = (
            f"links: intra-node {self.links['intra_node_gbps']:.3g} Gbit/s per rank, "
            f"{self.links['intra_node_latency_us']:.0f} us"
        )
        if self.links.get("inter_node_gbps") is not None:
            text += (
                f"; inter-node {self.links['inter_node_gbps']:.3g} Gbit/s per node, "
                f"{self.links['inter_node_latency_us']:.0f} us"
            )
        return text + f" (probe {self.links['probe_seconds']:.2f} s)"
