"""Exact resume: a resumed run trains on exactly the batches, in exactly the order, the interrupted run would have.

What a checkpoint does not hold is rebuilt or checked here: the data order (:mod:`data_order`), the position inside
an epoch for an ordinary DataLoader (:mod:`resumable_loader`; a ``Stateful`` stream's position on each rank:
:mod:`stream_position`) or the package's own batches (:mod:`resumable_batches`, :mod:`epoch_permutation`), a
checkpoint taken at an epoch end (:mod:`epoch_end_checkpoint`), and layers that draw random numbers
(:mod:`random_layers`). The strategy wires them to Lightning's hooks; checkpoint files themselves live in
:mod:`lightning_hpz.checkpointing`.
"""
