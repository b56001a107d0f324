"""Triton matrix-vector products for decode: y[M, N] = x[M, K] W[N, K]^T (+ b), M from 1 to 16.

At decode's batch sizes a step is nothing but reading the weights once, and cuBLAS's small-M kernels
leave HBM bandwidth unused on the 8B layer shapes (well under the copy bandwidth, with split-K reduce
kernels besides; the figures are in docs/benchmarks.md, GPU decode). Each
program here owns BLOCK_N output columns for every row of x and streams its [BLOCK_N, K] slice of W
once in [BLOCK_N, BLOCK_K] tiles, accumulating in fp32. One row (M = 1) multiplies on CUDA cores;
several rows go through `tl.dot` with x padded to 16 rows (fp32 operands in IEEE precision, never TF32;
bf16 widened to fp32 under the CPU interpreter, as in triton_attention.py). No split-K, so no second
kernel and no atomics: the result is deterministic and each product is one launch.

Invariants: x and W share a dtype (bf16, fp16 or fp32), or W is float8_e4m3fn with one fp32 scale per
row (shared/model/fp8.py: widened in registers, the scale applied to the fp32 sum); both have unit stride
along K; y is new, x's dtype, rounded once from the fp32 sum (x scale, + bias); the launcher never
synchronises with the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from pdserve.kernels.triton_attention import dot_dtype

MAX_ROWS = 16  # x rows one launch takes; larger batches belong to a GEMM


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
):  # fmt: skip
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    if M_PAD == 1:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            k_mask = kk < K
            x = tl.load(x_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
            w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if HAS_SCALE:
            acc *= tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)
    else:
        offs_m = tl.arange(0, M_PAD)
        m_mask = offs_m < M
        acc2 = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            k_mask = kk < K
            x2 = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                         mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
            w2 = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc2 += tl.dot(
                x2.to(DOT_DTYPE), tl.trans(w2.to(DOT_DTYPE)), input_precision="ieee", out_dtype=tl.float32
            )
        if HAS_SCALE:
            acc2 *= tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
        if HAS_BIAS:
            acc2 += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        y = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(y, acc2.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def default_config(n: int, k: int, rows: int) -> GemvConfig:
    """Tiles chosen by a sweep over the 8B layer shapes in bf16 (docs/benchmarks.md, GPU decode). One row:
    two output columns per program over all of K at once (up to 4096), the most programs and the longest
    loads in flight. Several rows: 32 x 256 tiles for tl.dot."""
    if rows == 1:
        return GemvConfig(block_n=2, block_k=min(4096, triton.next_power_of_2(k)), num_warps=8, num_stages=2)
    return GemvConfig(
        block_n=32, block_k=min(256, max(16, triton.next_power_of_2(k))), num_warps=4, num_stages=3
    )


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvConfig | None = None,
    *,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [M, K] with M <= MAX_ROWS; weight: [N, K] in x's dtype, or float8_e4m3fn with `scale` [N] fp32
    (W = weight * scale[:, None]); bias: [N] or None -> y [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    assert 1 <= m <= MAX_ROWS and weight.shape == (n, k), (
        f"gemv takes x [M<={MAX_ROWS}, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
    )
    fp8 = weight.dtype == torch.float8_e4m3fn
    assert (x.dtype == weight.dtype or fp8) and x.stride(1) == 1 and weight.stride(1) == 1, (
        f"x and weight must share a dtype (or the weight be FP8) and be contiguous along K, got "
        f"{x.dtype}/{weight.dtype}, strides {x.stride()}/{weight.stride()}"
    )
    assert fp8 == (scale is not None), "an FP8 weight comes with its scale, and only an FP8 weight"
    assert scale is None or (scale.shape == (n,) and scale.dtype == torch.float32 and scale.stride(0) == 1), (
        f"scale must be [{n}] fp32 contiguous, got {scale if scale is None else (scale.shape, scale.dtype)}"
    )
    assert bias is None or bias.shape == (n,), f"bias must be [{n}], got {tuple(bias.shape)}"
    cfg = config or default_config(n, k, m)
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, bias if bias is not None else weight, scale if scale is not None else weight, y, m, n, k,
        x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, HAS_SCALE=scale is not None,
        M_PAD=1 if m == 1 else MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_DTYPE=dot_dtype(x.dtype, x.device),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return y
