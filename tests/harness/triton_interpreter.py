"""Importing this puts a module of Triton kernel tests on the interpreter, on CPU tensors: on a machine with
CUDA it skips the importing module (the interpreter would stay on for every kernel test after it; the GPU
modules test the compiled kernels); elsewhere it hands the interpreter to triton's in-process knob.

Triton decides interpreted or compiled when a function is decorated, triton.language's own helpers
included, so tests/conftest.py sets TRITON_INTERPRET=1 before any test module imports triton; this module
then sets the knob and removes the variable from the environment, so that processes other tests start do
not inherit the interpreter, while kernels decorated later in this process are still interpreted.
"""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter only; the GPU modules test the compiled kernels", allow_module_level=True)

import triton

triton.knobs.runtime.interpret = True
os.environ.pop("TRITON_INTERPRET", None)
