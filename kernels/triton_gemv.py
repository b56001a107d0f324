"""Triton matrix-vector products for decode: y[M, N] = x[M, K] W[N, K]^T (+ b), M from 1 to 64.

At decode's batch sizes a step is nothing but reading the weights once, and cuBLAS's small-M kernels leave
HBM bandwidth unused on the 8B layer shapes (well under the copy bandwidth, with split-K reduce kernels
besides; the figures are in docs/benchmarks.md, GPU decode). Each program here owns BLOCK_N output columns
for every row of x and streams its [BLOCK_N, K / split_k] slice of W once in [BLOCK_N, BLOCK_K] tiles,
accumulating in fp32. One row (M = 1) multiplies on CUDA cores; several rows go through `tl.dot` with x
padded to 16, 32 or 64 rows (the next power of two, at least 16; fp32 operands in IEEE precision, never
TF32; bf16 widened to fp32 under the CPU interpreter, as in triton_attention.py). Up to 16 rows always run
here; 17 to 64 rows (batched decode) run here only where kernels/gemv_configs.json holds a tile measured
faster than cuBLAS for the device, weight dtype, shape and row bucket (`runs_gemv`), else the caller uses
cuBLAS. Without split-K a product is one launch. With split-K (shapes whose output columns give fewer
programs than SMs) each program writes its slice's fp32 partial sums to a
workspace and a second kernel adds them in split order, then scales, adds the bias and casts: deterministic,
no atomics, no zeroed workspace. (Reducing in the same launch, the last split of a column block taking a
ticket from an atomic counter, measured slower on the H200 at most real splits and won no shape:
docs/benchmarks.md, GPU decode GEMV.) Both kernels launch with programmatic dependent launch where the
device has it (kernels/pdl.py, whose invariants they keep); where the table's `prefetch` says so for the
shape, a GEMV program first asks L2 for its first weight tile, then waits for the kernel before it: the
weights never depend on that kernel, so reading them overlaps its tail and the launch; x, the workspace and
y are touched only after the wait. One row over several K steps sums the products elementwise in an fp32
tile and reduces across the program's threads once, after the loop (a reduction per step is a barrier per
step), where that tile fits in 32 registers a thread. `gemv_silu_mul` is the MLP's gate | up product with
SiLU(gate) x up in the epilogue: each program reads its outputs' gate rows and up rows and writes only
[M, F]: per decode layer one launch fewer and no [M, 2F] intermediate. The tiles come from the table of
kernels/gemv_configs.py (measured per device and shape; the [2F, K] entry is measured on the fused kernel),
else from its heuristic.

Invariants: x and W share a dtype (bf16, fp16 or fp32), or W is float8_e4m3fn with one fp32 scale per
row (shared/model/fp8.py: widened in registers, the scale applied to the fp32 sum); both have unit stride
along K; y is new, x's dtype, rounded once from the fp32 sum (x scale, + bias); the fused SiLU x up rounds
gate, up and silu(gate) where the unfused GEMV and kernels/triton_fused.py's SiLU x up do, so the two give
the same bits at the same tiles; a split covers a whole number of BLOCK_K steps, so no tile straddles two
splits; the launcher never synchronises with the device.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from pdserve.kernels.gemv_configs import (
    GEMV_ROWS,
    M_BUCKETS,
    TUNED,
    GemvConfig,
    TableKey,
    default_config,
    m_bucket,
)
from pdserve.kernels.pdl import pdl_launch, pdl_wait
from pdserve.kernels.triton_attention import dot_dtype

__all__ = ["MAX_ROWS", "GemvConfig", "choose_config", "gemv", "gemv_silu_mul", "runs_gemv"]

MAX_ROWS = M_BUCKETS[-1]  # x rows one launch takes; larger batches belong to a GEMM
_INTERPRETER_SM_COUNT = 4  # CPU tensors only run under the interpreter; few SMs keep split-K exercised
_REDUCE_BLOCK = 256  # output columns per program of the split-K reduction
_LINE_BYTES = 128  # what one L2 prefetch asks for


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, s_ptr, y_ptr, p_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, SPLIT: tl.constexpr, GLU: tl.constexpr,
    ACC_2D: tl.constexpr, ACC_G: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, LINE: tl.constexpr,
    W_VEC: tl.constexpr,
):  # fmt: skip
    # program (n block, split): K_SPLIT is a multiple of BLOCK_K; without SPLIT it covers all of K.
    # GLU: W is [gate; up] ([2F, K], N = 2F) and a program owns BLOCK_N // 2 outputs j, reading gate row j
    # and up row F + j (BLOCK_N weight rows in all); y = silu(gate) * up [M, F]. Else BLOCK_N rows of y.
    OUT_N: tl.constexpr = BLOCK_N // 2 if GLU else BLOCK_N
    n_out = N // 2 if GLU else N
    offs_n = tl.program_id(0) * OUT_N + tl.arange(0, OUT_N)
    k_lo = tl.program_id(1) * K_SPLIT
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < n_out
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    u_rows = w_rows + n_out * stride_wn  # GLU: the up rows
    if PDL and PREFETCH:  # LINE: weight elements per 128-byte line
        _prefetch_l2(w_ptr, w_rows, k_lo, K, n_mask, BLOCK_K, LINE)
        if GLU:
            _prefetch_l2(w_ptr, u_rows, k_lo, K, n_mask, BLOCK_K, LINE)
    pdl_wait(PDL)
    if M_PAD == 1:
        # ACC_2D (several K steps per program): products summed elementwise and reduced across the
        # program's threads once, after the loop, not once per step
        # ACC_G > 1: each thread first adds ACC_G neighbouring products of its own, so the fp32 tile is
        # ACC_G times smaller (fewer registers, more programs resident, more bytes in flight)
        if ACC_2D:
            acc_t = tl.zeros((OUT_N, BLOCK_K // ACC_G), dtype=tl.float32)
            acc_u_t = tl.zeros((OUT_N, BLOCK_K // ACC_G), dtype=tl.float32)
        acc = tl.zeros((OUT_N,), dtype=tl.float32)
        acc_u = tl.zeros((OUT_N,), dtype=tl.float32)
        for k0 in range(k_lo, k_lo + K_SPLIT, BLOCK_K):
            kk = k0 + offs_k
            k_mask = kk < K
            w_mask = n_mask[:, None] & k_mask[None, :]
            x = tl.load(x_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)[None, :]
            # W_VEC: weight loads of W_VEC elements a thread; FP8 at 8 takes bf16 x's layout (16-byte loads),
            # so x is not relaid out through shared memory, between two barriers, every K step
            kw = tl.max_contiguous(kk, W_VEC) if W_VEC > 0 else kk
            w = tl.load(w_rows + kw[None, :], mask=w_mask, other=0.0)
            if GLU:
                u = tl.load(u_rows + kw[None, :], mask=w_mask, other=0.0)
                if ACC_2D:
                    acc_u_t += _grouped(u.to(tl.float32) * x, ACC_G)
                else:
                    acc_u += tl.sum(u.to(tl.float32) * x, axis=1)
            if ACC_2D:
                acc_t += _grouped(w.to(tl.float32) * x, ACC_G)
            else:
                acc += tl.sum(w.to(tl.float32) * x, axis=1)
        if ACC_2D:
            acc = tl.sum(acc_t, axis=1)
            if GLU:
                acc_u = tl.sum(acc_u_t, axis=1)
        if SPLIT:  # partials [split, 1, N]
            tl.store(p_ptr + tl.program_id(1) * N + offs_n, acc, mask=n_mask)
            if GLU:
                tl.store(p_ptr + tl.program_id(1) * N + n_out + offs_n, acc_u, mask=n_mask)
        else:
            out = _epilogue(acc, acc_u, b_ptr, s_ptr, offs_n, n_mask, n_out, y_ptr.dtype.element_ty,
                            HAS_BIAS, HAS_SCALE, GLU)  # fmt: skip
            tl.store(y_ptr + offs_n, out, mask=n_mask)
    else:
        offs_m = tl.arange(0, M_PAD)
        m_mask = offs_m < M
        acc2 = tl.zeros((M_PAD, OUT_N), dtype=tl.float32)
        acc2_u = tl.zeros((M_PAD, OUT_N), dtype=tl.float32)
        for k0 in range(k_lo, k_lo + K_SPLIT, BLOCK_K):
            kk = k0 + offs_k
            k_mask = kk < K
            w_mask = n_mask[:, None] & k_mask[None, :]
            x2 = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                         mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(DOT_DTYPE)  # fmt: skip
            w2 = tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0)
            acc2 += tl.dot(x2, tl.trans(w2.to(DOT_DTYPE)), input_precision="ieee", out_dtype=tl.float32)
            if GLU:
                u2 = tl.load(u_rows + kk[None, :], mask=w_mask, other=0.0)
                acc2_u += tl.dot(x2, tl.trans(u2.to(DOT_DTYPE)), input_precision="ieee", out_dtype=tl.float32)
        out_mask = m_mask[:, None] & n_mask[None, :]
        if SPLIT:  # partials [split, M, N]
            part = p_ptr + (tl.program_id(1) * M + offs_m[:, None]) * N + offs_n[None, :]
            tl.store(part, acc2, mask=out_mask)
            if GLU:
                tl.store(part + n_out, acc2_u, mask=out_mask)
        else:
            out2 = _epilogue(acc2, acc2_u, b_ptr, s_ptr, offs_n[None, :], n_mask[None, :], n_out,
                             y_ptr.dtype.element_ty, HAS_BIAS, HAS_SCALE, GLU)  # fmt: skip
            tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], out2, mask=out_mask)


@triton.jit
def _grouped(prod, G: tl.constexpr):
    # [R, C] -> [R, C // G]: sums of G neighbours along C (one thread's contiguous elements)
    if G == 1:
        return prod
    return tl.sum(tl.reshape(prod, (prod.shape[0], prod.shape[1] // G, G)), axis=2)


@triton.jit
def _epilogue(acc, acc_u, b_ptr, s_ptr, offs, mask, n_out, OUT_TY: tl.constexpr, HAS_BIAS: tl.constexpr,
              HAS_SCALE: tl.constexpr, GLU: tl.constexpr):  # fmt: skip
    # fp32 sums -> the output in OUT_TY: x scale, + bias; GLU: gate and up each rounded to OUT_TY as the
    # unfused product rounds them, silu(gate) rounded before the multiply as the unfused SiLU kernel does
    if HAS_SCALE:
        acc *= tl.load(s_ptr + offs, mask=mask, other=0.0)
        if GLU:
            acc_u *= tl.load(s_ptr + n_out + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if GLU:
        gate = acc.to(OUT_TY).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(OUT_TY).to(tl.float32)
        acc = silu * acc_u.to(OUT_TY).to(tl.float32)
    return acc.to(OUT_TY)


@triton.jit
def _splitk_reduce_kernel(
    p_ptr, b_ptr, s_ptr, y_ptr, M, N, SPLITS, stride_ym,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, GLU: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # program (column block, row): adds the partials [SPLITS, M, N] in split order, the same every run;
    # GLU: output column j from partial columns j (gate) and N / 2 + j (up)
    pdl_wait(PDL)
    row = tl.program_id(1)
    n_out = N // 2 if GLU else N
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_out
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, SPLITS):
        acc += tl.load(p_ptr + (s * M + row) * N + offs, mask=mask, other=0.0)
        if GLU:
            acc_u += tl.load(p_ptr + (s * M + row) * N + n_out + offs, mask=mask, other=0.0)
    out = _epilogue(acc, acc_u, b_ptr, s_ptr, offs, mask, n_out, y_ptr.dtype.element_ty, HAS_BIAS, HAS_SCALE,
                    GLU)  # fmt: skip
    tl.store(y_ptr + row * stride_ym + offs, out, mask=mask)


@triton.jit
def _prefetch_l2(base, rows, k_lo, K, n_mask, BLOCK_K: tl.constexpr, LINE: tl.constexpr):
    # one prefetch per 128-byte line of the program's first [rows, BLOCK_K] tile; lanes outside W ask for
    # W's first line (base) instead
    LINES: tl.constexpr = BLOCK_K // LINE if BLOCK_K > LINE else 1
    kk = k_lo + tl.arange(0, LINES) * LINE
    ptrs = tl.where(n_mask[:, None] & (kk < K)[None, :], rows + kk[None, :], base)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)  # fmt: skip


@functools.cache
def _device_facts(device: torch.device) -> tuple[str, int]:
    """(name as the config table keys it, SM count) of a device; CPU tensors run under the interpreter."""
    if device.type != "cuda":
        return "cpu", _INTERPRETER_SM_COUNT
    props = torch.cuda.get_device_properties(device)
    return torch.cuda.get_device_name(device), int(props.multi_processor_count)


def _table_key(device: torch.device, weight_dtype: torch.dtype, n: int, k: int, rows: int) -> TableKey:
    return TableKey(_device_facts(device)[0], str(weight_dtype).removeprefix("torch."), n, k, m_bucket(rows))


def choose_config(device: torch.device, weight_dtype: torch.dtype, n: int, k: int, rows: int) -> GemvConfig:
    """The measured config of kernels/gemv_configs.json for this device, weight dtype, shape and row bucket,
    else the heuristic's."""
    tuned = TUNED.get(_table_key(device, weight_dtype, n, k, rows))
    return tuned or default_config(n, k, rows, _device_facts(device)[1])


def runs_gemv(device: torch.device, weight_dtype: torch.dtype, n: int, k: int, rows: int) -> bool:
    """Whether a product of `rows` rows over an [n, k] weight belongs to `gemv` rather than cuBLAS: always
    up to 16 rows; 17 to MAX_ROWS only where the table holds this device's, dtype's, shape's and bucket's tile
    (benchmarks/gemv_sweep.py writes one only where the GEMV measured faster than cuBLAS)."""
    if rows <= GEMV_ROWS:
        return rows >= 1
    return rows <= MAX_ROWS and _table_key(device, weight_dtype, n, k, rows) in TUNED


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvConfig | None = None,
    *,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [M, K] with M <= MAX_ROWS (64); weight: [N, K] in x's dtype, or float8_e4m3fn with `scale` [N] fp32
    (W = weight * scale[:, None]); bias: [N] or None -> y [M, N] in x's dtype. `config`: the tiles, by
    default `choose_config`'s."""
    return _launch(x, weight, bias, scale, config, glu=False)


def gemv_silu_mul(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: GemvConfig | None = None,
    *,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [M, K] with M <= MAX_ROWS (64); weight: [2F, K] (gate rows, then up rows) as for `gemv` ->
    silu(x gate^T) * (x up^T): [M, F] in x's dtype, the same bits as `gemv` followed by the SiLU x up kernel
    (kernels/triton_fused.py) at the same tiles, in one launch (two with split-K) and without the [M, 2F]
    intermediate. `config`: the tiles of the [2F, K] product (block_n counts weight rows, at least 2)."""
    assert weight.shape[0] % 2 == 0, f"gate+up weight must have an even row count, got {tuple(weight.shape)}"
    return _launch(x, weight, None, scale, config, glu=True)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    scale: torch.Tensor | None,
    config: GemvConfig | None,
    glu: bool,
) -> torch.Tensor:
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
    # GLU: a program's gate and up rows are BLOCK_N together; tl.dot (several rows) needs 16 outputs
    block_n = max(cfg.block_n, 2 if m == 1 else 32) if glu else cfg.block_n
    n_out = n // 2 if glu else n
    steps = triton.cdiv(k, cfg.block_k)
    split = min(cfg.split_k, steps)  # no split without a step of K to read
    k_split = triton.cdiv(steps, split) * cfg.block_k
    split = triton.cdiv(k, k_split)  # rounding k_split up can leave the last splits empty: drop them
    # one row over several K steps: products summed elementwise, reduced once, if the fp32 tile stays
    # within 32 registers a thread; FP8 adds 4 neighbours first (ACC_G), which frees registers for more
    # resident programs (4x1024 at 4 warps: 64 -> 48 a thread)
    acc_2d = m == 1 and k_split > cfg.block_k and block_n * cfg.block_k <= 32 * 32 * cfg.num_warps
    y = torch.empty((m, n_out), device=x.device, dtype=x.dtype)
    part = torch.empty((split, m, n), device=x.device, dtype=torch.float32) if split > 1 else y
    pdl = pdl_launch(x.device)
    _gemv_kernel[(triton.cdiv(n_out, block_n // 2 if glu else block_n), split)](
        x, weight, bias if bias is not None else weight, scale if scale is not None else weight, y, part,
        m, n, k, k_split, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, HAS_SCALE=scale is not None,
        M_PAD=1 if m == 1 else max(16, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=cfg.block_k,
        DOT_DTYPE=dot_dtype(x.dtype, x.device), SPLIT=split > 1, GLU=glu, ACC_2D=acc_2d,
        ACC_G=4 if fp8 and acc_2d else 1, PREFETCH=cfg.prefetch,
        LINE=_LINE_BYTES // weight.element_size(), W_VEC=8 if cfg.narrow_w and m == 1 else 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl,
    )  # fmt: skip
    if split > 1:
        _splitk_reduce_kernel[(triton.cdiv(n_out, _REDUCE_BLOCK), m)](
            part, bias if bias is not None else part, scale if scale is not None else part, y,
            m, n, split, y.stride(0),
            HAS_BIAS=bias is not None, HAS_SCALE=scale is not None, GLU=glu, BLOCK=_REDUCE_BLOCK,
            num_warps=4, **pdl,
        )  # fmt: skip
    return y
