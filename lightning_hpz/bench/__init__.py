"""A two-node, rate-limited benchmark on one machine: ``lightning-hpz bench`` (see :mod:`lightning_hpz.bench.command`).

Layers: :mod:`.testbed` (namespaces, veth, tc) -> :mod:`.launch` (torchrun per node) -> :mod:`.worker` (one rank:
:mod:`.lightning_worker` or :mod:`.manual_workers`, recording with :mod:`.recording`) -> :mod:`.results`.
"""
