# Set-up is part of each target: a fresh machine needs only `make quickstart` or `make test`.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
# pytest-xdist workers (each a process of a few GB; 2 suits a 2-core, 24 GiB machine); WORKERS=0 runs in one process.
# The tests that start process groups may run beside each other: each torchrun test has a port of its own, and
# Lightning's ddp picks a free one.
WORKERS ?= 2
# --durations: the slowest tests close each run's output, to keep the suite near 20 minutes on 2 cores; after them
# tests/conftest.py lists the tests that raised a worker's or a subprocess's peak memory.
PYTEST := $(BIN)/python -m pytest -q -n $(WORKERS) --durations=30

.PHONY: install quickstart lint test test-fast

$(VENV)/.installed: pyproject.toml plugins/rlcu-repetition/pyproject.toml plugins/rlcu-guess-number/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test]" -e plugins/rlcu-repetition -e plugins/rlcu-guess-number
	touch $@

install: $(VENV)/.installed

quickstart: install
	$(BIN)/rlcu run quickstart

lint: install
	$(BIN)/ruff check .

test: lint
	$(PYTEST)

test-fast: install
	$(PYTEST) -m "not slow"
