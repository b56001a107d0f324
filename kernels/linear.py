"""Dense products y = x W^T (+ b) over the model's weights, implemented per device and dtype.

Invariants: `prepare(weight)` is called once a weight's values are final and returns the handle that
`linear(x, handle, bias)` takes; the handle is a snapshot (a later in-place change to the weight needs a new
`prepare`). The result is the same product either way, up to fp32 summation order.

Why two: on a CPU in fp32, oneDNN's matmul over a weight re-laid out once for it (the weight pre-packing an
inductor CPU build does) reads and multiplies faster than `F.linear` over the plain row-major weight at the
batch sizes of decode (1-64 rows; docs/benchmarks.md, Engine on the CPU). The packed copy costs the
weights' size again in host memory. On a GPU the handle is the weight
itself (CUDA graphs see the parameters); products of up to 16 rows (decode) run the Triton GEMV of
kernels/triton_gemv.py, which reads the 8B shapes' weights faster than cuBLAS's small-M kernels (the
gate | up product with SiLU x up fused into its epilogue: `linear_silu_mul`), 17 to 64 rows run it where its
tuned table says it measured faster than cuBLAS on this device and shape (`runs_gemv`), and the rest
`F.linear` (cuBLAS). Elsewhere (CPU in other dtypes) it is `F.linear` over the weight as stored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F


class Linear(Protocol):
    name: str

    def prepare(self, weight: torch.Tensor, scale: torch.Tensor | None = None) -> Any:
        """weight: [N, K] -> the handle `linear` takes (may be the weight itself). `scale`: [N] fp32 rowwise
        scales of a quantized weight (shared/model/fp8.py's Fp8Linear); None for the dense products."""

    def linear(self, x: torch.Tensor, handle: Any, bias: torch.Tensor | None) -> torch.Tensor:
        """x: [T, K] -> [T, N]; `handle`: what `prepare` returned."""

    def linear_silu_mul(
        self, x: torch.Tensor, handle: Any, silu_mul: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """x: [T, K], `handle` of a [2F, K] gate | up weight -> silu(gate) * up: [T, F], as
        `silu_mul(self.linear(x, handle, None))` (the op the caller would run unfused) computes it."""


class DenseLinear:
    """`F.linear` over the weight as stored."""

    name = "dense"

    def prepare(self, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        assert scale is None, f"{self.name} multiplies unquantized weights"
        return weight

    def linear(self, x: torch.Tensor, handle: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, handle, bias)

    def linear_silu_mul(
        self, x: torch.Tensor, handle: torch.Tensor, silu_mul: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        return silu_mul(F.linear(x, handle))


class OneDnnPackedLinear:
    """oneDNN (mkldnn) matmul over a weight packed once in its blocked layout; CPU, fp32 only."""

    name = "onednn-packed"

    def prepare(self, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        assert scale is None, f"{self.name} multiplies unquantized weights"
        assert weight.dim() == 2 and weight.dtype == torch.float32 and weight.device.type == "cpu", (
            f"onednn-packed weights are 2-D fp32 on the CPU, got {tuple(weight.shape)} {weight.dtype} "
            f"on {weight.device}"
        )
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
        return packed

    def linear(self, x: torch.Tensor, handle: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        assert x.dim() == 2 and x.shape[1] == handle.shape[1], (
            f"x must be [T, {handle.shape[1]}], got {tuple(x.shape)}"
        )
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x.contiguous(), handle, bias, "none", [], "")
        return y

    def linear_silu_mul(
        self, x: torch.Tensor, handle: torch.Tensor, silu_mul: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        return silu_mul(self.linear(x, handle, None))


class GemvLinear:
    """Triton GEMV for decode-sized products (rows <= 16, and up to 64 where tuned faster), cuBLAS for the
    rest; CUDA."""

    name = "triton-gemv"

    def __init__(self) -> None:
        # triton comes with the [gpu] extra: a CPU install has none, and never builds this class
        from pdserve.kernels import triton_gemv

        self._gemv, self._gemv_silu_mul = triton_gemv.gemv, triton_gemv.gemv_silu_mul
        self._runs_gemv = triton_gemv.runs_gemv

    def prepare(self, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        assert scale is None, f"{self.name} multiplies unquantized weights"
        return weight

    def linear(self, x: torch.Tensor, handle: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self._runs_gemv(x.device, handle.dtype, handle.shape[0], handle.shape[1], x.shape[0]):
            return self._gemv(x if x.stride(-1) == 1 else x.contiguous(), handle, bias)
        return F.linear(x, handle, bias)

    def linear_silu_mul(
        self, x: torch.Tensor, handle: torch.Tensor, silu_mul: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """Decode-sized: one GEMV launch with SiLU x up in its epilogue (no [T, 2F] intermediate)."""
        if self._runs_gemv(x.device, handle.dtype, handle.shape[0], handle.shape[1], x.shape[0]):
            return self._gemv_silu_mul(x if x.stride(-1) == 1 else x.contiguous(), handle)
        return silu_mul(F.linear(x, handle))


def select_linear(device: torch.device, dtype: torch.dtype) -> Linear:
    """Triton GEMV + cuBLAS on CUDA; the packed oneDNN product on a CPU with oneDNN in fp32; else dense."""
    if device.type == "cuda":
        return GemvLinear()
    if device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available():
        return OneDnnPackedLinear()
    return DenseLinear()
