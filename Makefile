# make demo: the main job on a local pod.   make test: lint, types, tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP_CORE := $(VENV)/.stamp-core
STAMP_TEST := $(VENV)/.stamp-test

.PHONY: demo test test-reference lint typecheck pytest bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP_CORE): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[jax]'
	touch $@

$(STAMP_TEST): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	touch $@ $(STAMP_CORE)

demo: $(STAMP_CORE)
	PATH="$(CURDIR)/$(BIN):$$PATH" bash examples/demo.sh

lint: $(STAMP_TEST)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: $(STAMP_TEST)
	$(BIN)/mypy

pytest: $(STAMP_TEST)
	$(BIN)/pytest

test: lint typecheck pytest

# Rerun the model tests against outputs transformers computes now (needs torch;
# TORCH names the wheel to install when it is missing).
TORCH ?= torch==2.13.0
REFERENCE_DIR ?= $(CURDIR)/.reference-fixtures
test-reference: $(STAMP_TEST)
	$(BIN)/python -c 'import torch' 2>/dev/null || $(BIN)/pip install -q '$(TORCH)'
	$(BIN)/python -c 'import transformers' 2>/dev/null || $(BIN)/pip install -q transformers
	rm -rf $(REFERENCE_DIR)
	$(BIN)/python tests/fixtures/make_qwen_fixtures.py --out $(REFERENCE_DIR)
	TPUPOD_MODEL_FIXTURES=$(REFERENCE_DIR) $(BIN)/pytest tests/test_model.py

bench: $(STAMP_TEST)
	$(BIN)/pip install -q -e '.[test,bench]'
	$(BIN)/python benchmarks/fanout.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .reference-fixtures
