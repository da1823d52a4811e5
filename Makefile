# Set-up is part of each target: a fresh machine needs only `make quickstart` or `make test`.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin

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
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"
