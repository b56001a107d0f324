"""Session-wide test setup.

Triton decides interpreted or compiled when each kernel is decorated, so on a machine without a GPU the
interpreter is switched on here, before any test module (or anything it imports, such as a benchmark
script) imports triton: every kernel then runs under TRITON_INTERPRET=1, as CI tests them. On a GPU machine
nothing is set and the kernels compile. A CPU install without triton (`make test`; triton is the [gpu] extra,
which `make test-extras` and CI add) collects none of the Triton kernels' test modules, and says so in the
header. Every test that needs triton or ucxx carries the `extras` marker: `make test-extras` runs `-m extras`.
`hf_smollm2`, the Hugging Face reference of the SmolLM2 GGUF (tests/harness/hf_reference.py), is loaded once
per session (on first use) for the modules that compare against it; `loaded`, the default model on the CPU in
float32, once per module that asks for it.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable

import numpy as np
import pytest
import torch
from pdserve.shared.cli.default_model import default_model_path
from pdserve.shared.model.loader import LoadedModel, load_model
from pdserve.tests.harness.hf_reference import HFSmolLM2, load_hf_smollm2


def _install_numpy24_index_fix() -> None:
    """triton 3.6.0's interpreter turns a 1-element array into a loop bound with int(array), which numpy
    >= 2.4 refuses; this is the upstream fix (triton-lang/triton#9171, PR #9172), applied until a triton
    release carries it. Every attention kernel loops over runtime bounds."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor: type, scope: interpreter._LangPatchScope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch


TRITON = importlib.util.find_spec("triton") is not None
collect_ignore = [] if TRITON else [
    "test_triton_kernels.py", "test_fused_kernels.py", "test_triton_gemv.py", "test_triton_compile.py",
    "test_fused_gpu.py", "test_triton_moe.py",
]  # fmt: skip


def pytest_report_header() -> str:
    return (
        "triton: installed"
        if TRITON
        else f"triton: not installed; {len(collect_ignore)} kernel test modules skipped"
    )


if not torch.cuda.is_available() and TRITON:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if np.lib.NumpyVersion(np.__version__) >= "2.4.0":
        _install_numpy24_index_fix()


@pytest.fixture(scope="session")
def hf_smollm2(tmp_path_factory: pytest.TempPathFactory) -> Callable[[], HFSmolLM2]:
    """Loads on the first call, not when a test asks for the fixture: pytest sets up session fixtures before
    module ones, and the parity module starts its own runs first so that they overlap the load."""
    return functools.cache(lambda: load_hf_smollm2(str(tmp_path_factory.mktemp("smollm2-safetensors"))))


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    """The default model (SmolLM2) on the CPU in float32, on one torch thread."""
    torch.set_num_threads(1)
    return load_model(default_model_path(), device=torch.device("cpu"), dtype=torch.float32)
