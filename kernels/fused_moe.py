"""Mixture-of-experts MLP kernels: the router's top-k and the experts' SwiGLU over the tokens routed to
them, weighted and summed per token.

Invariants: experts are stacked, `gate_up: [X, 2F, E]` (rows gate | up of each expert) and `down: [X, E, F]`
(F: this rank's share of each expert's intermediate dim; the caller all-reduces a split's partial sums);
`route` returns a `Routing` (int64 expert ids and fp32 weights, `[T, K]`, checked once); every
implementation returns `[T, E]` in x's dtype, each token's K expert outputs summed in fp32 (rounded once).
`route` is the router's reference (softmax, top-k, renormalisation); each implementation routes through
its own `route`, which gives the same experts and weights (in any order among tied logits). The torch
reference here groups the (token, expert) pairs by expert and runs one fused gate/up product and one down
product per expert that has tokens (the CPU path and the oracle); the GPU one is the Triton kernels of
kernels/triton_moe.py (a grouped GEMM) and kernels/triton_moe_decode.py (few pairs: GEMVs).
`select_moe_experts` picks one by device, once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class Routing:
    """Each token's top K experts: `ids` [T, K] int64 and their weights [T, K] fp32."""

    ids: Tensor
    weights: Tensor

    def __post_init__(self) -> None:
        assert self.ids.dim() == 2 and self.ids.shape == self.weights.shape, (
            tuple(self.ids.shape), tuple(self.weights.shape)
        )  # fmt: skip
        assert self.ids.dtype == torch.int64 and self.weights.dtype == torch.float32, (
            self.ids.dtype, self.weights.dtype
        )  # fmt: skip


class MoEExperts(Protocol):
    name: str

    def route(self, router_logits: Tensor, top_k: int, renormalize: bool) -> Routing:
        """router_logits: [T, X] -> `route`'s routing (an implementation may fuse its ops)."""

    def __call__(self, x: Tensor, gate_up: Tensor, down: Tensor, routing: Routing) -> Tensor:
        """x: [T, E]; gate_up: [X, 2F, E]; down: [X, E, F] -> sum_k routing.weights[t, k] * down[e] @
        (silu(gate[e] x_t) * up[e] x_t), e = routing.ids[t, k]: [T, E] in x's dtype."""


def route(router_logits: Tensor, top_k: int, renormalize: bool) -> Routing:
    """router_logits: [T, X] -> each token's top K: softmax over all X experts in fp32, the top K,
    renormalised to sum to 1 if `renormalize` (Hugging Face's Qwen-MoE and Mixtral routers)."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, X]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, K] each
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(ids, weights)


def check_experts(x: Tensor, gate_up: Tensor, down: Tensor, routing: Routing) -> None:
    n_experts, two_f, hidden = gate_up.shape
    assert x.dim() == 2 and x.shape[1] == hidden, (tuple(x.shape), tuple(gate_up.shape))
    assert down.shape == (n_experts, hidden, two_f // 2), (tuple(down.shape), tuple(gate_up.shape))
    assert routing.ids.shape[0] == x.shape[0], (tuple(routing.ids.shape), tuple(x.shape))
    assert gate_up.dtype == down.dtype == x.dtype, (x.dtype, gate_up.dtype, down.dtype)


class ReferenceMoEExperts:
    """Torch: pairs sorted by expert, then per expert with tokens one [n, E] x [E, 2F] product, SiLU x up,
    one [n, F] x [F, E] product; the weighted rows are added into their tokens in fp32."""

    name = "torch-grouped"

    def route(self, router_logits: Tensor, top_k: int, renormalize: bool) -> Routing:
        return route(router_logits, top_k, renormalize)

    def __call__(self, x: Tensor, gate_up: Tensor, down: Tensor, routing: Routing) -> Tensor:
        check_experts(x, gate_up, down, routing)
        n_tokens, top_k = routing.ids.shape
        f = down.shape[2]
        flat = routing.ids.flatten()  # [T*K] pair p is (token p // K, its k-th expert)
        order = torch.argsort(flat, stable=True)  # [T*K] pairs grouped by expert
        counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
        token_of = order // top_k  # [T*K]
        rows = x[token_of]  # [T*K, E]
        out = torch.empty(rows.shape, dtype=torch.float32, device=x.device)  # [T*K, E]
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            h = F.linear(rows[start : start + n], gate_up[expert])  # [n, 2F]
            act = F.silu(h[:, :f]) * h[:, f:]  # [n, F]
            out[start : start + n] = F.linear(act, down[expert])  # [n, E]
            start += n
        out.mul_(routing.weights.flatten()[order].unsqueeze(1))
        y = torch.zeros(n_tokens, x.shape[1], dtype=torch.float32, device=x.device)  # [T, E]
        return y.index_add_(0, token_of, out).to(x.dtype)


def select_moe_experts(device: torch.device) -> MoEExperts:
    """The fused Triton kernel on CUDA, the torch reference elsewhere."""
    if device.type == "cuda":
        from pdserve.kernels.triton_moe import TritonMoEExperts

        return TritonMoEExperts()
    return ReferenceMoEExperts()
