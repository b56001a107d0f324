"""The mixture-of-experts MLP at decode's few (token, expert) pairs: no sort, no padded row blocks, three
small kernels, none of whose grids depends on the routing (so a CUDA graph holds them; no host sync).

1. `fused_route` (`_route_kernel`, one program per token): softmax over the X router logits in fp32, the
   top K by K passes of argmax (ties go to the lower expert id), renormalised when the config says:
   ids [T, K] int64 and weights [T, K] fp32, as kernels/fused_moe.py's `route` gives them.
2. `_gate_up_gemv_kernel` over (pair, BLOCK_N columns of F): reads the pair's expert id from the top-k ids
   on the device and streams that expert's gate and up rows once on CUDA cores (one x row is a GEMV, as in
   kernels/triton_gemv.py), SiLU(gate) x up in the epilogue: act [T*K, F].
3. `_down_sum_kernel` over (token, BLOCK_N columns of E): the token's K pairs side by side, one
   [K, BLOCK_N, BLOCK_K] load of their down rows per step (every pair's bytes in flight at once), each
   pair's product with its act row in fp32, rounded to the model's dtype as the reference's F.linear is,
   weighted by the pair's routing weight and summed over the pairs in fp32 registers, rounded once:
   [T, E]; no [T*K, E] buffer and no separate sum.
All three launch with programmatic dependent launch where the device has it and keep kernels/pdl.py's
invariants: each waits first (the logits, the routing and the activations come from the kernel before,
and which expert's weights to read is known only from the routing).
Rounding follows the reference (kernels/fused_moe.py) exactly as kernels/triton_moe.py does. Each pair
reads its expert's weights even when two pairs share an expert, which is why this path stops at
`DECODE_MAX_PAIRS` and the grouped GEMM (kernels/triton_moe.py) reads each selected expert once above it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from pdserve.kernels.fused_moe import Routing, route
from pdserve.kernels.pdl import pdl_launch, pdl_wait
from torch import Tensor

DECODE_MAX_PAIRS = 64
"""T*K at or below which the decode path runs (qwen3-30b-a3b: T <= 8); benchmarks/moe_decode.py times
both paths at T = 1, 4, 16, 64 to place it."""
FUSED_ROUTE_MAX_EXPERTS = 256  # one program holds a token's X logits in registers
FUSED_ROUTE_MAX_TOP_K = 8  # K argmax passes over them


@dataclass(frozen=True)
class DecodeTiles:
    gate_up_block_n: int  # columns of F per program (gate and up rows each)
    gate_up_block_k: int
    gate_up_warps: int
    down_block_n: int  # columns of E per program
    down_block_k: int
    down_warps: int


def default_decode_tiles(hidden: int, f: int) -> DecodeTiles:
    """Measured at qwen3-30b-a3b's shape on an H200 (E 2048, F 768, top 8; a sweep of block n, block k
    and warps per kernel, docs/benchmarks.md): gate/up one column of F per program (gate and up rows) over
    1024 of E at a time, 4 warps; down two columns of E per program over 256 of F at a time for all K pairs
    at once, 8 warps."""
    return DecodeTiles(
        gate_up_block_n=1,
        gate_up_block_k=min(1024, triton.next_power_of_2(hidden)),
        gate_up_warps=4,
        down_block_n=2,
        down_block_k=min(256, triton.next_power_of_2(f)),
        down_warps=8,
    )


@triton.jit
def _route_kernel(
    logits_ptr, ids_ptr, weights_ptr, X, stride_lt,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, X_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, X_PAD)
    logits = tl.load(logits_ptr + t * stride_lt + offs, mask=offs < X, other=float("-inf")).to(tl.float32)
    e = tl.exp(logits - tl.max(logits, axis=0))  # padding: exp(-inf) = 0
    probs = e / tl.sum(e, axis=0)  # [X_PAD]
    slots = tl.arange(0, K_PAD)
    ids = tl.zeros((K_PAD,), dtype=tl.int64)
    weights = tl.zeros((K_PAD,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        best = tl.max(probs, axis=0)
        idx = tl.min(tl.where(probs == best, offs, X_PAD), axis=0)  # the lowest id among ties
        ids = tl.where(slots == k, idx.to(tl.int64), ids)
        weights = tl.where(slots == k, best, weights)
        probs = tl.where(offs == idx, -1.0, probs)  # below every probability, padding's 0 included
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)
    out = t * TOP_K + slots
    tl.store(ids_ptr + out, ids, mask=slots < TOP_K)
    tl.store(weights_ptr + out, weights, mask=slots < TOP_K)


def fused_route(router_logits: Tensor, top_k: int, renormalize: bool) -> Routing:
    """router_logits: [T, X] -> kernels/fused_moe.py's `route` in one kernel (X <= 256, K <= 8; torch ops
    beyond)."""
    n_tokens, n_experts = router_logits.shape
    if n_experts > FUSED_ROUTE_MAX_EXPERTS or top_k > FUSED_ROUTE_MAX_TOP_K:
        return route(router_logits, top_k, renormalize)
    assert router_logits.stride(1) == 1, (
        f"router logits must be contiguous by expert, got {router_logits.stride()}"
    )
    ids = torch.empty((n_tokens, top_k), device=router_logits.device, dtype=torch.int64)  # [T, K]
    weights = torch.empty((n_tokens, top_k), device=router_logits.device, dtype=torch.float32)  # [T, K]
    _route_kernel[(n_tokens,)](
        router_logits, ids, weights, n_experts, router_logits.stride(0),
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), X_PAD=triton.next_power_of_2(n_experts),
        RENORMALIZE=renormalize, num_warps=1, **pdl_launch(router_logits.device),
    )  # fmt: skip
    return Routing(ids, weights)


@triton.jit
def _gate_up_gemv_kernel(
    x_ptr, w_ptr, act_ptr, ids_ptr, top_k, F, K, stride_xm, stride_we, stride_wn, stride_am,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(PDL)
    pair = tl.program_id(0)
    token = (pair // top_k).to(tl.int64)
    expert = tl.load(ids_ptr + pair)  # int64, from the routing on the device
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_mask = offs_n < F
    offs_k = tl.arange(0, BLOCK_K)
    w_gate = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn  # [BN, 1] gate rows
    w_up = w_gate + F * stride_wn
    acc_gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        xv = tl.load(x_ptr + token * stride_xm + kk, mask=k_mask, other=0.0).to(tl.float32)  # [BK]
        w_mask = n_mask[:, None] & k_mask[None, :]
        g = tl.load(w_gate + kk[None, :], mask=w_mask, other=0.0).to(tl.float32)  # [BN, BK]
        u = tl.load(w_up + kk[None, :], mask=w_mask, other=0.0).to(tl.float32)
        acc_gate += tl.sum(g * xv[None, :], axis=1)
        acc_up += tl.sum(u * xv[None, :], axis=1)
    # rounded to the model's dtype where the reference rounds (the interpreter has no bf16 arithmetic)
    out_ty = act_ptr.dtype.element_ty
    gate = acc_gate.to(out_ty).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
    act = silu * acc_up.to(out_ty).to(tl.float32)
    tl.store(act_ptr + pair.to(tl.int64) * stride_am + offs_n, act.to(out_ty), mask=n_mask)


@triton.jit
def _down_sum_kernel(
    act_ptr, w_ptr, out_ptr, ids_ptr, weights_ptr, N, K, stride_am, stride_we, stride_wn, stride_om,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_mask = offs_n < N
    slots = tl.arange(0, K_PAD)
    s_mask = slots < TOP_K
    pairs = token * TOP_K + slots  # [KP]
    experts = tl.load(ids_ptr + pairs, mask=s_mask, other=0)  # [KP] int64
    # all K pairs' rows in one [KP, BN, BK] load per step, so every pair's bytes are in flight at once
    w = w_ptr + experts[:, None, None] * stride_we + offs_n[None, :, None].to(tl.int64) * stride_wn
    w_mask = s_mask[:, None, None] & n_mask[None, :, None]
    a_rows = act_ptr + pairs[:, None] * stride_am  # [KP, 1]
    offs_k = tl.arange(0, BLOCK_K)
    part = tl.zeros((K_PAD, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        a = tl.load(a_rows + kk[None, :], mask=s_mask[:, None] & k_mask[None, :], other=0.0)  # [KP, BK]
        b = tl.load(w + kk[None, None, :], mask=w_mask & k_mask[None, None, :], other=0.0)  # [KP, BN, BK]
        part += tl.sum(b.to(tl.float32) * a.to(tl.float32)[:, None, :], axis=2)
    # each pair's product rounded to the model's dtype, as the reference's F.linear is, then weighted
    weights = tl.load(weights_ptr + pairs, mask=s_mask, other=0.0)  # [KP] fp32
    acc = tl.sum(part.to(act_ptr.dtype.element_ty).to(tl.float32) * weights[:, None], axis=0)  # [BN]
    tl.store(out_ptr + token * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


def moe_decode(
    x: Tensor, gate_up: Tensor, down: Tensor, routing: Routing, tiles: DecodeTiles | None = None
) -> Tensor:
    """x: [T, E]; gate_up: [X, 2F, E]; down: [X, E, F] (contiguous along their last dim, checked by the
    caller) -> [T, E] in x's dtype, each token's K experts summed in fp32."""
    n_tokens, top_k = routing.ids.shape
    hidden, f = down.shape[1:]
    t = tiles or default_decode_tiles(hidden, f)
    pdl = pdl_launch(x.device)
    ids = routing.ids.contiguous()  # [T, K]: pair p is (token p // K, its k-th expert)
    act = torch.empty((n_tokens * top_k, f), device=x.device, dtype=x.dtype)  # [T*K, F]
    _gate_up_gemv_kernel[(n_tokens * top_k, triton.cdiv(f, t.gate_up_block_n))](
        x, gate_up, act, ids, top_k, f, hidden, x.stride(0), gate_up.stride(0), gate_up.stride(1),
        act.stride(0), BLOCK_N=t.gate_up_block_n, BLOCK_K=t.gate_up_block_k,
        num_warps=t.gate_up_warps, **pdl,
    )  # fmt: skip
    out = torch.empty((n_tokens, hidden), device=x.device, dtype=x.dtype)  # [T, E]
    _down_sum_kernel[(n_tokens, triton.cdiv(hidden, t.down_block_n))](
        act, down, out, ids, routing.weights.contiguous(), hidden, f, act.stride(0), down.stride(0),
        down.stride(1), out.stride(0),
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), BLOCK_N=t.down_block_n, BLOCK_K=t.down_block_k,
        num_warps=t.down_warps, **pdl,
    )  # fmt: skip
    return out
