# Set-up and entry points for a machine without a GPU (CPU wheel of torch, see requirements/cpu.txt).
PYTHON ?= python3

.PHONY: install quickstart test test-versions lint

install:
	$(PYTHON) -m pip install --quiet -r requirements/cpu.txt
	$(PYTHON) -m pip install --quiet --no-deps -r requirements/litgpt.txt

# the main job: a tiny Llama-2 trained with strategy "hpz" on 4 CPU processes (two simulated nodes of two)
quickstart: install
	$(PYTHON) -m lightning_hpz.cli fit --config configs/quickstart.yaml

# the test suite; pytest's own exit code (5 = no tests ran) fails the target. Real multi-process DeepSpeed tests run
# either way; the longest launches (marker `slow`) only where CI is set, as on CI: `CI=true make test` runs everything.
# Two test files at a time (pytest-xdist, `--dist loadfile`: a file's tests and its module fixtures, most of them
# launches of several processes, stay on one worker): a launch spends much of its time waiting (process start-up,
# rendezvous, shaped links, timeouts under test), which the other file's work fills. `--no-loadscope-reorder` starts
# the files in the order tests/conftest.py gives them (longest first), not xdist's most-tests-first.
# TEST_WORKERS=0 runs serially. docs/development.md says how the suite is scheduled.
TEST_WORKERS ?= 2
test: install
	$(PYTHON) -m pytest tests $(if $(CI),,-m "not slow") -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

# The version subset in a fresh environment per supported DeepSpeed minor, Lightning minor and the newest torch
# (tests/version_matrix.py, docs/versions.md): about 10 minutes per combination on 2 cores; not part of `make test`.
# VERSIONS picks combinations (`$(PYTHON) tests/version_matrix.py --list`), e.g. VERSIONS="deepspeed-0.16 torch-2.15".
VERSIONS ?=
test-versions: install
	$(PYTHON) tests/version_matrix.py $(VERSIONS)

lint:
	ruff check lightning_hpz tests benchmarks examples
	ruff format --check lightning_hpz tests benchmarks examples
