"""The fused mixture-of-experts MLP on the GPU: (token, expert) pairs sorted by expert, then two grouped
GEMMs over the selected experts only. Up to `DECODE_MAX_PAIRS` pairs (decode), `TritonMoEExperts` takes
kernels/triton_moe_decode.py's unsorted GEMV path instead, and routes through its one-kernel router always.

1. `align_pairs` (torch, no host sync, so a CUDA graph can hold it): the T*K pairs sorted by expert, each
   expert's run padded to a multiple of BLOCK_M with the pad id T*K, and the expert of every BLOCK_M block;
   a row block holds one expert's pairs, so each program reads one expert's weights.
2. `_gate_up_kernel`: per (row block, BLOCK_N columns of F) the gate and up tiles of that expert in one
   K loop (x read once for both), then SiLU(gate) x up in the epilogue: act [T*K, F], one row per pair.
3. `_down_kernel`: act x down[e]^T, scaled by the pair's routing weight in the epilogue, fp32 out
   [T*K, E]; the K pairs of each token are summed in fp32 and rounded once.
Blocks past the padded total exit at once (the grid is sized for the worst case, so its shape does not
depend on the routing). fp32 operands multiply in IEEE precision, never TF32; bf16 is widened to fp32 under
the CPU interpreter (`dot_dtype`). Rounding follows the reference (kernels/fused_moe.py): gate and up
rounded to x's dtype, SiLU rounded, the product rounded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from pdserve.kernels.fused_moe import Routing, check_experts
from pdserve.kernels.triton_attention import dot_dtype
from pdserve.kernels.triton_moe_decode import DECODE_MAX_PAIRS, DecodeTiles, fused_route, moe_decode
from torch import Tensor


@dataclass(frozen=True)
class MoETiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def choose_tiles(n_pairs: int) -> MoETiles:
    """Decode (a few pairs per expert): 16-row blocks, so little of a block is padding; prefill: 64."""
    if n_pairs <= 256:
        return MoETiles(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
    return MoETiles(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)


@dataclass(frozen=True)
class AlignedPairs:
    sorted_pairs: torch.Tensor  # [P_max] int32: pair ids grouped by expert; pad = T*K
    block_expert: torch.Tensor  # [P_max / BLOCK_M] int32: the expert of each row block
    num_padded: torch.Tensor  # [1] int64: rows in use (blocks at or past it exit)


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedPairs:
    """topk_ids: [T, K] int64 -> the pairs sorted by expert, each expert's run padded to block_m."""
    flat = topk_ids.flatten()  # [T*K]
    n = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [X]
    padded = (counts + block_m - 1) // block_m * block_m  # [X]
    ends = torch.cumsum(padded, 0)  # [X]
    order = torch.argsort(flat, stable=True)  # [T*K]
    expert_sorted = flat[order]  # [T*K]
    first = torch.cumsum(counts, 0) - counts  # [X] each expert's first index in `order`
    rank = torch.arange(n, device=flat.device) - first[expert_sorted]  # [T*K]
    dest = ends[expert_sorted] - padded[expert_sorted] + rank  # [T*K]
    # at most min(n, X) experts have pairs, each padding fewer than block_m rows
    max_rows = triton.cdiv(n + min(n, num_experts) * (block_m - 1), block_m) * block_m
    sorted_pairs = torch.full((max_rows,), n, dtype=torch.int32, device=flat.device)
    sorted_pairs[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, max_rows, block_m, device=flat.device)  # [P_max / BLOCK_M]
    block_expert = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return AlignedPairs(sorted_pairs, block_expert.to(torch.int32), ends[-1:])


@triton.jit
def _row_block(
    pairs_ptr, block_expert_ptr, w_ptr, n_pairs, N, stride_we, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """This program's row block and column tile: its pair ids [BM] (and which are not padding), the
    output columns [BN] (and which are in range), and the block's expert's weight rows of those columns
    [1, BN] (pointers to their first element)."""
    pairs = tl.load(pairs_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    expert = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    w = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn  # [1, BN]
    return pairs, pairs < n_pairs, offs_n, offs_n < N, w


@triton.jit
def _k_step(a_ptr, rows, stride_am, valid, n_mask, k0, K, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """One step of a kernel's K loop (inlined): the block's rows [BM] of A at columns k0 .. k0 + BK as a
    [BM, BK] tile in DOT_DTYPE, those columns' offsets [BK, 1] into a weight row, and the [BK, BN] mask of
    the weight tile beside it."""
    kk = k0 + tl.arange(0, BLOCK_K)  # [BK]
    k_mask = kk < K
    a = tl.load(a_ptr + rows[:, None] * stride_am + kk[None, :],
                mask=valid[:, None] & k_mask[None, :], other=0.0).to(DOT_DTYPE)  # fmt: skip
    return a, kk[:, None], k_mask[:, None] & n_mask[None, :]


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, act_ptr, pairs_ptr, block_expert_ptr, num_padded_ptr, n_pairs, top_k, F, K,
    stride_xm, stride_we, stride_wn, stride_am,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs, valid, offs_n, n_mask, w_gate = _row_block(
        pairs_ptr, block_expert_ptr, w_ptr, n_pairs, F, stride_we, stride_wn, BLOCK_M, BLOCK_N
    )  # w_gate: [1, BN] rows of gate; up's are F rows further
    tokens = (pairs // top_k).to(tl.int64)
    w_up = w_gate + F * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a, kk, w_mask = _k_step(x_ptr, tokens, stride_xm, valid, n_mask, k0, K, BLOCK_K, DOT_DTYPE)
        g = tl.load(w_gate + kk, mask=w_mask, other=0.0).to(DOT_DTYPE)  # [BK, BN]
        u = tl.load(w_up + kk, mask=w_mask, other=0.0).to(DOT_DTYPE)
        acc_gate = tl.dot(a, g, acc_gate, input_precision="ieee", out_dtype=tl.float32)
        acc_up = tl.dot(a, u, acc_up, input_precision="ieee", out_dtype=tl.float32)
    # arithmetic in fp32, rounded to the output dtype where the reference rounds (the interpreter has no
    # bf16 arithmetic)
    out_ty = act_ptr.dtype.element_ty
    gate = acc_gate.to(out_ty).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
    act = silu * acc_up.to(out_ty).to(tl.float32)
    dst = act_ptr + pairs[:, None].to(tl.int64) * stride_am + offs_n[None, :]
    tl.store(dst, act.to(out_ty), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(
    act_ptr, w_ptr, out_ptr, weights_ptr, pairs_ptr, block_expert_ptr, num_padded_ptr, n_pairs, N, K,
    stride_am, stride_we, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs, valid, offs_n, n_mask, w = _row_block(
        pairs_ptr, block_expert_ptr, w_ptr, n_pairs, N, stride_we, stride_wn, BLOCK_M, BLOCK_N
    )
    rows = pairs.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a, kk, w_mask = _k_step(act_ptr, rows, stride_am, valid, n_mask, k0, K, BLOCK_K, DOT_DTYPE)
        b = tl.load(w + kk, mask=w_mask, other=0.0).to(DOT_DTYPE)  # [BK, BN]
        acc = tl.dot(a, b, acc, input_precision="ieee", out_dtype=tl.float32)
    # the product rounded to the model's dtype, as the reference's F.linear is, then weighted in fp32
    acc = acc.to(act_ptr.dtype.element_ty).to(tl.float32)
    acc *= tl.load(weights_ptr + rows, mask=valid, other=0.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_om + offs_n[None, :], acc, mask=valid[:, None] & n_mask[None, :]
    )


class TritonMoEExperts:
    """The decode path (kernels/triton_moe_decode.py) up to `decode_max_pairs` pairs, the grouped kernels
    above past it; their tiles by the shape (`choose_tiles`, `default_decode_tiles`) unless given. Which
    path runs depends only on T, so each CUDA graph's batch bucket holds one."""

    name = "triton-fused-moe"

    def __init__(
        self,
        tiles: MoETiles | None = None,
        decode_max_pairs: int = DECODE_MAX_PAIRS,
        decode_tiles: DecodeTiles | None = None,
    ) -> None:
        self.tiles = tiles
        self.decode_max_pairs = decode_max_pairs
        self.decode_tiles = decode_tiles

    def route(self, router_logits: Tensor, top_k: int, renormalize: bool) -> Routing:
        return fused_route(router_logits, top_k, renormalize)

    def __call__(self, x: Tensor, gate_up: Tensor, down: Tensor, routing: Routing) -> Tensor:
        check_experts(x, gate_up, down, routing)
        assert x.stride(1) == 1 and gate_up.stride(2) == 1 and down.stride(2) == 1, (
            f"x, gate_up and down must be contiguous along their last dim, got strides {x.stride()}, "
            f"{gate_up.stride()}, {down.stride()}"
        )
        n_tokens, top_k = routing.ids.shape
        n_experts, hidden, f = down.shape
        n_pairs = n_tokens * top_k
        if n_pairs <= self.decode_max_pairs:
            return moe_decode(x, gate_up, down, routing, self.decode_tiles)
        t = self.tiles or choose_tiles(n_pairs)
        aligned = align_pairs(routing.ids, n_experts, t.block_m)
        n_blocks = aligned.block_expert.shape[0]
        dot = dot_dtype(x.dtype, x.device)
        act = torch.empty((n_pairs, f), device=x.device, dtype=x.dtype)  # [T*K, F]
        _gate_up_kernel[(n_blocks, triton.cdiv(f, t.block_n))](
            x, gate_up, act, aligned.sorted_pairs, aligned.block_expert, aligned.num_padded, n_pairs, top_k,
            f, hidden, x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0),
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, DOT_DTYPE=dot,
            num_warps=t.num_warps, num_stages=t.num_stages,
        )  # fmt: skip
        out = torch.empty((n_pairs, hidden), device=x.device, dtype=torch.float32)  # [T*K, E]
        _down_kernel[(n_blocks, triton.cdiv(hidden, t.block_n))](
            act, down, out, routing.weights.contiguous(), aligned.sorted_pairs, aligned.block_expert,
            aligned.num_padded, n_pairs, hidden, f,
            act.stride(0), down.stride(0), down.stride(1), out.stride(0),
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, DOT_DTYPE=dot,
            num_warps=t.num_warps, num_stages=t.num_stages,
        )  # fmt: skip
        return out.view(n_tokens, top_k, hidden).sum(dim=1).to(x.dtype)  # [T, E]
