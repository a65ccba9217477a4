"""``lightning-hpz study``: a scaling study of ZeRO stages x model size x micro-batch as one reproducible command.

Layers (nothing imports upwards; only :mod:`.worker` and :mod:`.measurement` import torch at module level, and they
run in the cells' own processes):

* :mod:`.study_config` reads and validates the YAML; :mod:`.grid` expands it into :class:`~.grid.StudyCell` s.
* :mod:`.cell_runner` runs one cell in its own processes (:mod:`.worker` is each rank's entry point, measuring with
  :mod:`.measurement`); :mod:`.cell_summary` turns the ranks' records into one result line, next to the planner's
  prediction (:mod:`.prediction`).
* :mod:`.results_log` appends the lines (JSON lines, resumable); :mod:`.report` and :mod:`.plots` write the table and
  the figures (both read :mod:`.analysis`); :mod:`.command` ties them together with a progress bar.

What it shares with :mod:`lightning_hpz.bench`, and why the rest stays apart, is said in that package's docstring.
"""
