# make demo: the main job on a local pod.   make test: lint, types, tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP_CORE := $(VENV)/.stamp-core
STAMP_TEST := $(VENV)/.stamp-test

.PHONY: demo test lint typecheck pytest bench clean

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

bench: $(STAMP_TEST)
	$(BIN)/pip install -q -e '.[test,bench]'
	$(BIN)/python benchmarks/fanout.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
