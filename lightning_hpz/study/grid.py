"""The study's cells: the product of its grid axes, each cell one training run in its own processes."""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

from lightning_hpz.study.cell_strategy import uses_hpz
from lightning_hpz.study.study_config import StudyConfig


@dataclass(frozen=True)
class StudyCell:
    """One point of the grid. ``hpz_partition_size`` is 1 for strategies without hpZ."""

    model: str
    strategy: str
    micro_batch_size: int
    precision: str
    hpz_partition_size: int = 1

    @property
    def strategy_label(self) -> str:
        """``zero3``, or ``hpz(2)`` with the hpZ size, as tables and plots name it."""
        return f"{self.strategy}({self.hpz_partition_size})" if self.hpz_partition_size > 1 else self.strategy

    @property
    def cell_id(self) -> str:
        """Stable name of the cell: the key a resumed study skips finished cells by."""
        return f"{self.model}:{self.strategy_label}:mb{self.micro_batch_size}:{self.precision}"

    def to_dict(self) -> dict:
        return asdict(self)


def expand_grid(config: StudyConfig) -> list[StudyCell]:
    """Every cell of the grid, model-major (the smallest model first when models are listed by size).

    hpZ sizes multiply only the strategies that use hpZ; on several nodes with no sizes given, hpZ takes the devices
    per node (what ``hpz_partition_size='auto'`` resolves to).
    """
    grid = config.grid
    cells = []
    for model, strategy, micro_batch, precision in itertools.product(
        grid.models, grid.strategies, grid.micro_batch_sizes, grid.precisions
    ):
        for hpz in _hpz_sizes(config, strategy):
            cells.append(StudyCell(model, strategy, micro_batch, precision, hpz))
    return cells


def _hpz_sizes(config: StudyConfig, strategy: str) -> tuple[int, ...]:
    if not uses_hpz(strategy):
        return (1,)
    return config.grid.hpz_partition_sizes or (config.devices_per_node,)
