# Everything runs inside .venv, created on first use from python3 (>= 3.11).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,notebooks]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m flax_shardmeta demo

test: $(STAMP)
	$(BIN)/ruff check flax_shardmeta tests benchmarks
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/pip install --quiet -e '.[test,bench]'
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
