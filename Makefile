# tokenbus: `make up` starts the whole stack, `make test` runs the whole suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev
RUNSTAMP := $(VENV)/.installed

.PHONY: up test lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(RUNSTAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	touch $@

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@ $(RUNSTAMP)

## Create .venv, install, and run the stack (embedded nats-server + every service + sim workers).
up: $(RUNSTAMP)
	$(BIN)/tokenbus up

## Create/update .venv with the dev extras and run the whole suite: lint, types, tests.
test: lint
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

## The foundation benchmark: through tokenbus vs straight to the same sim engine.
bench: $(RUNSTAMP)
	$(BIN)/tokenbus bench --spawn --concurrency 1,256 --out bench-results/foundation.json

clean:
	rm -rf $(VENV) .tokenbus bench-results *.egg-info
