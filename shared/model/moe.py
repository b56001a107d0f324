"""The mixture-of-experts MLP of a decoder layer (Qwen3-MoE, Mixtral, Qwen2-MoE): a router, stacked routed
experts, and an optional shared expert; and the Hugging Face names of their tensors.

Invariants: the experts are held stacked as the kernels take them (`gate_up_weight: [X, 2F, E]`, rows
gate | up of each expert; `down_weight: [X, E, F]`), F being this rank's slice of every expert's
intermediate dim (shared/model/parallel.py: gate/up column-parallel, down row-parallel). The router (and the
shared expert's 1-row gate) is replicated: every rank routes the same tokens to the same experts. `forward`
returns this rank's partial sum of the routed and shared experts' outputs; the layer all-reduces it once.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from pdserve.kernels.fused_moe import select_moe_experts
from pdserve.kernels.linear import DenseLinear, Linear
from pdserve.kernels.ops import AttentionOps
from pdserve.shared.model.model_config import ModelConfig
from pdserve.shared.model.parallel import RowSlice, TPPlan
from torch import nn

_MIXTRAL_PROJ = {"gate": "w1", "up": "w3", "down": "w2"}


class Take(Protocol):
    def __call__(self, name: str, dst: torch.Tensor, part: RowSlice | None = None) -> None:
        """Copy checkpoint tensor `name` (or rows `part` of it) into `dst`; ValueError if it is missing or
        misshapen."""


def moe_prefix(cfg: ModelConfig, layer: int) -> str:
    block = "block_sparse_moe." if cfg.architecture == "mixtral" else "mlp."
    return f"model.layers.{layer}.{block}"


def expert_name(cfg: ModelConfig, layer: int, expert: int, proj: str) -> str:
    """proj: gate, up or down."""
    name = _MIXTRAL_PROJ[proj] if cfg.architecture == "mixtral" else f"{proj}_proj"
    return f"{moe_prefix(cfg, layer)}experts.{expert}.{name}.weight"


def moe_hf_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """The Hugging Face-named tensors of layer `layer`'s sparse MLP and their shapes."""
    assert cfg.moe is not None, cfg.architecture
    e, f, fs = cfg.hidden_size, cfg.moe.intermediate_size, cfg.moe.shared_expert_intermediate_size
    p = moe_prefix(cfg, layer)
    shapes: dict[str, tuple[int, ...]] = {p + "gate.weight": (cfg.moe.num_experts, e)}
    for j in range(cfg.moe.num_experts):
        shapes[expert_name(cfg, layer, j, "gate")] = (f, e)
        shapes[expert_name(cfg, layer, j, "up")] = (f, e)
        shapes[expert_name(cfg, layer, j, "down")] = (e, f)
    if fs:
        shapes[p + "shared_expert.gate_proj.weight"] = (fs, e)
        shapes[p + "shared_expert.up_proj.weight"] = (fs, e)
        shapes[p + "shared_expert.down_proj.weight"] = (e, fs)
        shapes[p + "shared_expert_gate.weight"] = (1, e)
    return shapes


def _param(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPPlan, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None, cfg.architecture
        x, e, f, fs = (
            moe.num_experts,
            cfg.hidden_size,
            tp.expert_intermediate_size,
            tp.shared_expert_intermediate_size,
        )
        self.top_k, self.renormalize = moe.top_k, moe.norm_topk_prob
        self.router_weight = _param((x, e), device, dtype)
        self.gate_up_weight = _param((x, 2 * f, e), device, dtype)  # per expert rows: gate | up
        self.down_weight = _param((x, e, f), device, dtype)
        self.shared_gate_up_weight = _param((2 * fs, e), device, dtype) if fs else None
        self.shared_down_weight = _param((e, fs), device, dtype) if fs else None
        self.shared_gate_weight = _param((1, e), device, dtype) if fs else None
        self.experts = select_moe_experts(device)
        self.prepare(DenseLinear())

    def prepare(self, linear: Linear) -> None:
        """The router's and the shared expert's matmul handles (the routed experts go through `experts` as
        stored); on GPU the router's [X, E] product is then the decode GEMV, not a cuBLAS launch."""
        self.linear = linear
        self.router_w = linear.prepare(self.router_weight.detach())
        if self.shared_gate_up_weight is not None and self.shared_down_weight is not None:
            self.shared_gate_up_w = linear.prepare(self.shared_gate_up_weight.detach())
            self.shared_down_w = linear.prepare(self.shared_down_weight.detach())

    def forward(self, x: torch.Tensor, ops: AttentionOps) -> torch.Tensor:
        """x: [T, E] normed -> [T, E] this rank's partial sum (the caller all-reduces)."""
        logits = self.linear.linear(x, self.router_w, None)  # [T, X]
        routing = self.experts.route(logits, self.top_k, self.renormalize)  # [T, K] each
        y = self.experts(x, self.gate_up_weight, self.down_weight, routing)  # [T, E]
        if self.shared_gate_weight is None:
            return y
        act = self.linear.linear_silu_mul(x, self.shared_gate_up_w, ops.silu_mul)  # [T, F_shared]
        shared = self.linear.linear(act, self.shared_down_w, None)
        return y.add_(torch.sigmoid(F.linear(x, self.shared_gate_weight)) * shared)  # [T, E]

    def load(self, cfg: ModelConfig, layer: int, tp: TPPlan, take: Take) -> None:
        """Copy layer `layer`'s router and experts (this rank's slice of each) through `take`."""
        assert cfg.moe is not None, cfg.architecture
        whole = tp.size == 1
        rows = None if whole else tp.expert_rows()
        cols = None if rows is None else rows.along(1)  # down is row-parallel over the same range
        f = tp.expert_intermediate_size
        p = moe_prefix(cfg, layer)
        take(p + "gate.weight", self.router_weight)
        for j in range(cfg.moe.num_experts):
            take(expert_name(cfg, layer, j, "gate"), self.gate_up_weight[j, :f], rows)
            take(expert_name(cfg, layer, j, "up"), self.gate_up_weight[j, f:], rows)
            take(expert_name(cfg, layer, j, "down"), self.down_weight[j], cols)
        if self.shared_gate_up_weight is not None and self.shared_down_weight is not None:
            fs = tp.shared_expert_intermediate_size
            srows = None if whole else tp.shared_expert_rows()
            scols = None if srows is None else srows.along(1)
            take(p + "shared_expert.gate_proj.weight", self.shared_gate_up_weight[:fs], srows)
            take(p + "shared_expert.up_proj.weight", self.shared_gate_up_weight[fs:], srows)
            take(p + "shared_expert.down_proj.weight", self.shared_down_weight, scols)
            assert self.shared_gate_weight is not None
            take(p + "shared_expert_gate.weight", self.shared_gate_weight)
