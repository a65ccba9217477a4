# Set-up and entry points for a machine without a GPU (CPU wheel of torch, see requirements/cpu.txt).
PYTHON ?= python3

.PHONY: install quickstart test lint

install:
	$(PYTHON) -m pip install --quiet -r requirements/cpu.txt

# the main job: a tiny Llama-2 trained with strategy "hpz" on 4 CPU processes (two simulated nodes of two)
quickstart: install
	$(PYTHON) -m lightning_hpz.cli fit --config configs/quickstart.yaml

# the whole test suite; pytest's own exit code (5 = no tests ran) fails the target
test: install
	$(PYTHON) -m pytest tests

lint:
	ruff check lightning_hpz tests benchmarks examples
	ruff format --check lightning_hpz tests benchmarks examples
