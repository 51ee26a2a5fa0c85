# Everything runs inside a venv made on first use. Two stacks:
#   .venv         the floor: python3 (3.11 in CI) with pyproject's minimum versions,
#                 pinned by .ci/floor.txt (`make demo`, `make test`, `make test-slow`);
#   .venv-latest  the newest Python on the machine (.ci/newest-python) with the
#                 newest jax / flax the index serves for it (`make test-latest`).
# An extra for one stack is one word in its *_EXTRAS line. Both carry the tpu
# extra (libtpu, for TPU topologies) and the gpu extra (jax's CUDA plugin, for
# GPU clusters); dev/quiet_libtpu.pth and dev/quiet_cuda.pth keep them quiet in
# the venv's scripts off a TPU VM / GPU machine (see dev/README.md).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
FLOOR_EXTRAS := test,notebooks,tpu,gpu
PYTEST := $(BIN)/python -m pytest -n 2

LATEST_PYTHON ?= $(shell bash .ci/newest-python)
LATEST_VENV := .venv-latest
LATEST_BIN := $(LATEST_VENV)/bin
LATEST_STAMP := $(LATEST_VENV)/.installed
LATEST_EXTRAS := test,notebooks,tpu,gpu

.PHONY: demo test test-slow test-latest lint bench docs versions clean

# The demo needs the package and its runtime dependencies only (jax, flax, optax,
# numpy, treescope); the tests add their extras to the same venv.
$(DEMO_STAMP): pyproject.toml .ci/floor.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c .ci/floor.txt -e .
	touch $(DEMO_STAMP)

$(STAMP): $(DEMO_STAMP) pyproject.toml .ci/floor.txt dev/quiet_libtpu.pth dev/quiet_libtpu.py dev/quiet_cuda.pth dev/quiet_cuda.py
	$(BIN)/pip install --quiet -c .ci/floor.txt -e '.[$(FLOOR_EXTRAS)]'
	$(BIN)/python dev/install_pth.py
	touch $(STAMP)

$(LATEST_STAMP): pyproject.toml dev/quiet_libtpu.pth dev/quiet_libtpu.py dev/quiet_cuda.pth dev/quiet_cuda.py
	$(LATEST_PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_BIN)/pip install --quiet --upgrade pip
	$(LATEST_BIN)/pip install --quiet --upgrade --upgrade-strategy eager -e '.[$(LATEST_EXTRAS)]'
	$(LATEST_BIN)/python dev/install_pth.py
	touch $(LATEST_STAMP)

demo: $(DEMO_STAMP)
	@echo 'make demo: .venv holds the package and its runtime dependencies (jax, flax, optax, numpy, treescope); make test adds the test, notebook, TPU and GPU extras.'
	$(BIN)/python -m flax_shardmeta demo

# Lint, types and the default tests (the long end-to-end ones are marked slow).
test: lint
	$(PYTEST) -m 'not slow'

# The long end-to-end tests: full grids, subprocesses, notebooks, several processes.
test-slow: $(STAMP)
	$(PYTEST) -m slow

# The default tests again, on the newest Python, jax and flax.
test-latest: $(LATEST_STAMP)
	$(LATEST_BIN)/python -m pytest -n 2 -m 'not slow'

lint: $(STAMP)
	$(BIN)/ruff check flax_shardmeta tests benchmarks
	$(BIN)/ruff format --check flax_shardmeta tests benchmarks
	$(BIN)/pyright

# Which Python, jax and flax each stack has.
versions:
	@for py in $(BIN)/python $(LATEST_BIN)/python; do test -x $$py && $$py -c \
	  'import sys, jax, flax; print(sys.prefix, sys.version.split()[0], "jax", jax.__version__, "flax", flax.__version__)'; \
	done; true

# The documentation site, warnings as errors: docs/_build/html/index.html.
DOCS_STAMP := $(VENV)/.installed-docs

$(DOCS_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -c .ci/floor.txt -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(BIN)/sphinx-build -W --keep-going -q -b html docs docs/_build/html

bench: $(STAMP)
	$(BIN)/pip install --quiet -e '.[test,bench]'
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) $(LATEST_VENV) .pytest_cache .ruff_cache .hypothesis
