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

import ast
import functools
import importlib.util
import os
import pathlib
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


def _install_bf16_rounding_fix() -> None:
    """triton 3.6.0's interpreter narrows fp32 to bf16 by dropping the low mantissa bits (round toward zero),
    where the GPU's `x.to(tl.bfloat16)` rounds to nearest even: a kernel that rounds where its torch
    reference does drifted under the interpreter by an ulp toward zero at every rounding, the MoE kernels'
    five roundings by about 2 % of their output. The narrowing goes through torch's (round to nearest even)
    instead."""
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(
        self: interpreter.InterpreterBuilder, src: interpreter.TensorHandle, dst_type: tl.dtype
    ) -> interpreter.TensorHandle:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            wide = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            return interpreter.TensorHandle(wide.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16),
                                            tl.bfloat16)  # fmt: skip
        return original(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_impl


def _needs_triton() -> list[str]:
    """The test modules that import triton anywhere, directly or through one of the repository's modules that
    import it at their top (kernels/triton_*.py, benchmarks/kernels_gpu.py): found by reading them, so that a
    new kernel test cannot break the plain `make test` by being left off a list."""
    root = pathlib.Path(__file__).resolve().parent.parent

    def imports(path: pathlib.Path, anywhere: bool) -> set[str]:
        tree = ast.parse(path.read_text())
        names: set[str] = set()
        for node in ast.walk(tree) if anywhere else tree.body:
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)  # and each name as a submodule: `from pdserve.kernels import triton_x`
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
        return names

    def is_triton(name: str) -> bool:
        return name == "triton" or name.startswith("triton.")

    direct = {
        "pdserve." + ".".join(path.relative_to(root).with_suffix("").parts)
        for folder in ("kernels", "benchmarks")
        for path in (root / folder).glob("*.py")
        if any(is_triton(name) for name in imports(path, anywhere=False))
    }
    return sorted(
        path.name
        for path in (root / "tests").glob("test_*.py")
        if any(is_triton(name) or name in direct for name in imports(path, anywhere=True))
    )


TRITON = importlib.util.find_spec("triton") is not None
collect_ignore = [] if TRITON else _needs_triton()


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
    _install_bf16_rounding_fix()


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
