"""Triton matrix-vector products for decode: y[M, N] = x[M, K] W[N, K]^T (+ b), M from 1 to 16.

At decode's batch sizes a step is nothing but reading the weights once, and cuBLAS's small-M kernels
leave HBM bandwidth unused on the 8B layer shapes (well under the copy bandwidth, with split-K reduce
kernels besides; the figures are in docs/benchmarks.md, GPU decode). Each
program here owns BLOCK_N output columns for every row of x and streams its [BLOCK_N, K / split_k] slice of
W once in [BLOCK_N, BLOCK_K] tiles, accumulating in fp32. One row (M = 1) multiplies on CUDA cores;
several rows go through `tl.dot` with x padded to 16 rows (fp32 operands in IEEE precision, never TF32;
bf16 widened to fp32 under the CPU interpreter, as in triton_attention.py). Without split-K a product is
one launch. With split-K (shapes whose output columns give fewer programs than SMs) each program writes its
slice's fp32 partial sums to a workspace and a second kernel adds them in split order, then scales, adds
the bias and casts: deterministic, no atomics, no zeroed workspace. The tiles come from the table of
kernels/gemv_configs.py (measured per device and shape), else from its heuristic.

Invariants: x and W share a dtype (bf16, fp16 or fp32), or W is float8_e4m3fn with one fp32 scale per
row (shared/model/fp8.py: widened in registers, the scale applied to the fp32 sum); both have unit stride
along K; y is new, x's dtype, rounded once from the fp32 sum (x scale, + bias); a split covers a whole
number of BLOCK_K steps, so no tile straddles two splits; the launcher never synchronises with the device.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from pdserve.kernels.gemv_configs import TUNED, GemvConfig, TableKey, default_config, m_bucket
from pdserve.kernels.triton_attention import dot_dtype

__all__ = ["MAX_ROWS", "GemvConfig", "choose_config", "gemv"]

MAX_ROWS = 16  # x rows one launch takes; larger batches belong to a GEMM
_INTERPRETER_SM_COUNT = 4  # CPU tensors only run under the interpreter; few SMs keep split-K exercised
_REDUCE_BLOCK = 256  # output columns per program of the split-K reduction


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, s_ptr, y_ptr, p_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    # program (n block, split): K_SPLIT is a multiple of BLOCK_K; without SPLIT it covers all of K
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = tl.program_id(1) * K_SPLIT
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    if M_PAD == 1:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(k_lo, k_lo + K_SPLIT, BLOCK_K):
            kk = k0 + offs_k
            k_mask = kk < K
            x = tl.load(x_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
            w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if SPLIT:  # partials [split, 1, N]
            tl.store(p_ptr + tl.program_id(1) * N + offs_n, acc, mask=n_mask)
        else:
            if HAS_SCALE:
                acc *= tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)
    else:
        offs_m = tl.arange(0, M_PAD)
        m_mask = offs_m < M
        acc2 = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_lo + K_SPLIT, BLOCK_K):
            kk = k0 + offs_k
            k_mask = kk < K
            x2 = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                         mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
            w2 = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc2 += tl.dot(
                x2.to(DOT_DTYPE), tl.trans(w2.to(DOT_DTYPE)), input_precision="ieee", out_dtype=tl.float32
            )
        out_mask = m_mask[:, None] & n_mask[None, :]
        if SPLIT:  # partials [split, M, N]
            part = p_ptr + (tl.program_id(1) * M + offs_m[:, None]) * N + offs_n[None, :]
            tl.store(part, acc2, mask=out_mask)
        else:
            if HAS_SCALE:
                acc2 *= tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
            if HAS_BIAS:
                acc2 += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            y = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
            tl.store(y, acc2.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _splitk_reduce_kernel(
    p_ptr, b_ptr, s_ptr, y_ptr, M, N, SPLITS, stride_ym,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # program (column block, row): adds the partials [SPLITS, M, N] in split order, the same every run
    row = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, SPLITS):
        acc += tl.load(p_ptr + (s * M + row) * N + offs, mask=mask, other=0.0)
    if HAS_SCALE:
        acc *= tl.load(s_ptr + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _device_facts(device: torch.device) -> tuple[str, int]:
    """(name as the config table keys it, SM count) of a device; CPU tensors run under the interpreter."""
    if device.type != "cuda":
        return "cpu", _INTERPRETER_SM_COUNT
    props = torch.cuda.get_device_properties(device)
    return torch.cuda.get_device_name(device), int(props.multi_processor_count)


def choose_config(device: torch.device, weight_dtype: torch.dtype, n: int, k: int, rows: int) -> GemvConfig:
    """The measured config of kernels/gemv_configs.json for this device, weight dtype, shape and row bucket,
    else the heuristic's."""
    name, sms = _device_facts(device)
    key = TableKey(name, str(weight_dtype).removeprefix("torch."), n, k, m_bucket(rows))
    return TUNED.get(key) or default_config(n, k, rows, sms)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvConfig | None = None,
    *,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [M, K] with M <= MAX_ROWS; weight: [N, K] in x's dtype, or float8_e4m3fn with `scale` [N] fp32
    (W = weight * scale[:, None]); bias: [N] or None -> y [M, N] in x's dtype. `config`: the tiles, by
    default `choose_config`'s."""
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
    cfg = config or choose_config(x.device, weight.dtype, n, k, m)
    steps = triton.cdiv(k, cfg.block_k)
    split = min(cfg.split_k, steps)  # no split without a step of K to read
    k_split = triton.cdiv(steps, split) * cfg.block_k
    split = triton.cdiv(k, k_split)  # rounding k_split up can leave the last splits empty: drop them
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    part = torch.empty((split, m, n), device=x.device, dtype=torch.float32) if split > 1 else y
    _gemv_kernel[(triton.cdiv(n, cfg.block_n), split)](
        x, weight, bias if bias is not None else weight, scale if scale is not None else weight, y, part,
        m, n, k, k_split, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, HAS_SCALE=scale is not None,
        M_PAD=1 if m == 1 else MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_DTYPE=dot_dtype(x.dtype, x.device), SPLIT=split > 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if split > 1:
        _splitk_reduce_kernel[(triton.cdiv(n, _REDUCE_BLOCK), m)](
            part, bias if bias is not None else part, scale if scale is not None else part, y,
            m, n, split, y.stride(0),
            HAS_BIAS=bias is not None, HAS_SCALE=scale is not None, BLOCK=_REDUCE_BLOCK, num_warps=4,
        )  # fmt: skip
    return y
