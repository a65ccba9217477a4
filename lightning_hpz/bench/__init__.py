"""A two-node, rate-limited benchmark on one machine: ``lightning-hpz bench`` (see :mod:`lightning_hpz.bench.command`).

Layers: :mod:`.testbed` (namespaces, veth, tc) -> :mod:`.launch` (torchrun per node) -> :mod:`.worker` (one rank:
:mod:`.lightning_worker` or :mod:`.manual_workers`, recording with :mod:`.recording`) -> :mod:`.results`.

Shared with :mod:`lightning_hpz.study`: starting and ending the ranks (:mod:`lightning_hpz.lifecycle.launched_ranks`)
and the planner (:mod:`lightning_hpz.planning`). Kept apart on purpose: a bench rank records link counters and
per-step losses of configurations that run side by side, in rounds, on one testbed, and its prediction is cross-node
bytes per step; a study cell is one strategy at one size whose record is memory and throughput, and may end out of
memory. One worker, prediction or results format for both would carry the other's fields everywhere.
"""
