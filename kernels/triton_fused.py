"""Triton kernels for the elementwise work between a decoder layer's matrix products, one pass each:
residual add + RMSNorm, RoPE on q and k with the KV-cache write (Qwen3's per-head RMSNorm of q and k in
the same pass), and SiLU(gate) x up.

Each kernel rounds where the torch reference (kernels/reference.py) rounds, so the two agree to the last
bit in fp32 up to summation order and fused multiply-adds: the residual sum is rounded to the model
dtype before it is normalised, the norm runs in fp32 and is rounded before the weight multiply, RoPE
runs in fp32 on the fp32 cos/sin tables and is rounded once (into an FP8 cache: saturated to +-448 first,
as kernels/ops.py's `to_kv` does). Launchers take already-checked tensors
(kernels/triton_ops.py checks them) and never synchronise with the device, so decode stays capturable
in a CUDA graph. Every kernel launches with programmatic dependent launch where the device has it and keeps
kernels/pdl.py's invariants: before its wait only the norm's weight is read (RMSNorm), nothing else (RoPE's
positions, slots and the step's activations may come from the kernel before).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from pdserve.kernels.ops import FP8_KV_DTYPES, AttentionMetadata, QKNorm
from pdserve.kernels.pdl import pdl_launch, pdl_wait

_SILU_BLOCK = 1024  # elements of one row per program


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)  # a weight: no kernel of the step writes it
    pdl_wait(PDL)
    h = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        # the sum is rounded to the stream's dtype first, as torch's `residual + x` is
        h = (h.to(tl.float32) + r.to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_r + offs, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(hf * hf, 0) / n_cols + eps)
    normed = (hf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, normed * w.to(tl.float32), mask=mask)


@triton.jit
def _saturate(x, SAT: tl.constexpr):
    # x (fp32) clamped to +-SAT before a cast to an FP8 cache; SAT = 0: no bound
    if SAT > 0:
        x = tl.minimum(tl.maximum(x, -SAT), SAT)
    return x


@triton.jit
def _load_halves(src, mask, w_ptr, offs_d, d_mask, eps, HALF: tl.constexpr, NORM: tl.constexpr):
    # src: [H, HALF] pointers to the first halves of H heads -> both halves in fp32. NORM: each head
    # RMS-normalised over its 2 * HALF values and scaled by w [2 * HALF], rounded where the reference rounds
    # (the normed value, then its product with the weight)
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        ty = src.dtype.element_ty
        rstd = tl.math.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(w_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        x1 = ((x1 * rstd).to(ty).to(tl.float32) * w1).to(ty).to(tl.float32)
        x2 = ((x2 * rstd).to(ty).to(tl.float32) * w2).to(ty).to(tl.float32)
    return x1, x2


@triton.jit
def _rotate_store(x1, x2, dst, c, s, mask, HALF: tl.constexpr, SAT: tl.constexpr):
    # x1, x2: [H, HALF] fp32 halves of H heads; dst: [H, HALF] pointers to their first halves; c, s: [1, HALF]
    tl.store(dst, _saturate(x1 * c - x2 * s, SAT).to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, _saturate(x2 * c + x1 * s, SAT).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _copy_store(src, dst, mask, SAT: tl.constexpr):
    # src, dst: [H, HALF]; a plain copy, or saturated and rounded into an FP8 cache
    x = tl.load(src, mask=mask, other=0.0)
    if SAT > 0:
        x = _saturate(x.to(tl.float32), SAT).to(dst.dtype.element_ty)
    tl.store(dst, x, mask=mask)


@triton.jit
def _rope_write_kv_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, qw_ptr, kw_ptr, eps,
    stride_t, stride_cos, stride_cslot, stride_ch,
    N_Q: tl.constexpr, N_KV: tl.constexpr, HALF: tl.constexpr, Q_PAD: tl.constexpr, KV_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr, SAT: tl.constexpr, QK_NORM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token)
    offs_d = tl.arange(0, HALF_PAD)
    d_mask = offs_d < HALF
    c = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=d_mask, other=0.0)[None, :]
    s = tl.load(sin_ptr + pos * stride_cos + offs_d, mask=d_mask, other=0.0)[None, :]
    row = qkv_ptr + token * stride_t  # q heads, then k heads, then v heads, each 2 * HALF wide
    offs_q = tl.arange(0, Q_PAD)
    q = row + offs_q[:, None] * (2 * HALF) + offs_d[None, :]
    q_mask = (offs_q < N_Q)[:, None] & d_mask[None, :]
    q1, q2 = _load_halves(q, q_mask, qw_ptr, offs_d, d_mask, eps, HALF, QK_NORM)
    _rotate_store(q1, q2, q, c, s, q_mask, HALF, 0.0)  # q (normed and) rotated in place
    slot = tl.load(slots_ptr + token)
    if slot >= 0:
        offs_k = tl.arange(0, KV_PAD)
        kv_mask = (offs_k < N_KV)[:, None] & d_mask[None, :]
        k = row + (N_Q + offs_k[:, None]) * (2 * HALF) + offs_d[None, :]
        cache_off = slot * stride_cslot + offs_k[:, None] * stride_ch + offs_d[None, :]
        k1, k2 = _load_halves(k, kv_mask, kw_ptr, offs_d, d_mask, eps, HALF, QK_NORM)
        _rotate_store(k1, k2, k_cache_ptr + cache_off, c, s, kv_mask, HALF, SAT)
        v = k + N_KV * 2 * HALF
        v_cache = v_cache_ptr + cache_off
        _copy_store(v, v_cache, kv_mask, SAT)
        _copy_store(v + HALF, v_cache + HALF, kv_mask, SAT)


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr, out_ptr, stride_in, stride_out, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr
):  # fmt: skip
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    g = tl.load(gate_up_ptr + row * stride_in + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + row * stride_in + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    # silu is rounded to the output dtype before the multiply, as torch's `silu(gate) * up` is
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, act * u, mask=mask)


def _norm_warps(n_cols: int) -> int:
    return 4 if n_cols <= 2048 else 8 if n_cols <= 8192 else 16


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x: [T, E] -> normed [T, E] in x's dtype. With `residual` ([T, E], same dtype), first
    residual += x in place and normalise the sum. Rows must be contiguous (stride 1 along E)."""
    n_rows, n_cols = x.shape
    out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return out
    res = residual if residual is not None else x
    _rms_norm_kernel[(n_rows,)](
        x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), n_cols, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n_cols),
        num_warps=_norm_warps(n_cols), **pdl_launch(x.device),
    )  # fmt: skip
    return out


def rope_write_kv(
    qkv: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    num_heads: int,
    qk_norm: QKNorm | None = None,
) -> None:
    """qkv: [T, (Hq + 2 Hkv) * D], rows of q | k | v heads; q is rotated in place at meta.positions,
    rotated k and v go to meta.slot_mapping[t] of kv_layer [2, N, B, Hkv, D] (skipped where -1). With
    `qk_norm`, q and k heads are RMS-normalised per head first, in the same pass (k only on its way to the
    cache)."""
    n_tokens = qkv.shape[0]
    if n_tokens == 0:
        return
    n_kv, head_dim = kv_layer.shape[3], kv_layer.shape[4]
    half = head_dim // 2
    k_cache, v_cache = kv_layer[0], kv_layer[1]  # [N, B, Hkv, D]: slot = block * B + offset
    qw, kw, eps = (qkv, qkv, 0.0) if qk_norm is None else (qk_norm.q_weight, qk_norm.k_weight, qk_norm.eps)
    _rope_write_kv_kernel[(n_tokens,)](
        qkv, meta.positions, meta.rope.cos, meta.rope.sin, k_cache, v_cache, meta.slot_mapping, qw, kw, eps,
        qkv.stride(0), meta.rope.cos.stride(0), k_cache.stride(1), k_cache.stride(2),
        N_Q=num_heads, N_KV=n_kv, HALF=half, Q_PAD=triton.next_power_of_2(num_heads),
        KV_PAD=triton.next_power_of_2(n_kv), HALF_PAD=triton.next_power_of_2(half),
        SAT=torch.finfo(kv_layer.dtype).max if kv_layer.dtype in FP8_KV_DTYPES else 0.0,
        QK_NORM=qk_norm is not None, num_warps=4, **pdl_launch(qkv.device),
    )  # fmt: skip


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2F] (gate | up) -> silu(gate) * up [T, F] in gate_up's dtype."""
    n_rows, n_cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((n_rows, n_cols), dtype=gate_up.dtype, device=gate_up.device)
    if n_rows == 0:
        return out
    _silu_mul_kernel[(n_rows, triton.cdiv(n_cols, _SILU_BLOCK))](
        gate_up, out, gate_up.stride(0), out.stride(0), n_cols,
        BLOCK=_SILU_BLOCK, num_warps=4, **pdl_launch(gate_up.device),
    )  # fmt: skip
    return out
