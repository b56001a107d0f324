"""Session-wide test setup.

Triton decides interpreted or compiled when each kernel is decorated, so on a machine without a GPU the
interpreter is switched on here, before any test module (or anything it imports, such as a benchmark
script) imports triton: every kernel then runs under TRITON_INTERPRET=1, as CI tests them. On a GPU machine
nothing is set and the kernels compile.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
