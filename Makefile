# Everything runs inside .venv, created on first use from python3 (>= 3.11).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST := $(BIN)/python -m pytest -n 2

.PHONY: demo test test-slow lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,notebooks,tpu]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m flax_shardmeta demo

# Lint, types and the default tests (the long end-to-end ones are marked slow).
test: lint
	$(PYTEST) -m 'not slow'

# The long end-to-end tests: full grids, subprocesses, notebooks, several processes.
test-slow: $(STAMP)
	$(PYTEST) -m slow

lint: $(STAMP)
	$(BIN)/ruff check flax_shardmeta tests benchmarks
	$(BIN)/ruff format --check flax_shardmeta tests benchmarks
	$(BIN)/pyright

bench: $(STAMP)
	$(BIN)/pip install --quiet -e '.[test,bench]'
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
