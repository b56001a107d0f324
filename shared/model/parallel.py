"""Tensor-parallel sharding of the Llama-family model: which slice of every weight a rank holds, and the
collectives the model calls between its matrix products.

Invariants: `TPShard.plan` refuses (ValueError naming the heads and the size) any split that is not exact:
query heads and the MLP's intermediate size (and a mixture of experts' expert and shared-expert widths:
each rank holds its slice of every expert) divide by the size; KV heads either divide by it (each rank
holds `Hkv / N` of them) or divide it (each rank holds the one KV head its query heads use: replicated
`N / Hkv` times). Every rank holds the same number of query heads, KV heads and vocabulary rows, so every
rank's KV pool has the same shape and the collectives see the same tensor shapes. The vocabulary is split
in `ceil(V / N)` rows per rank; rows past V are zero (their logits are dropped after the gather, and no
token id reaches them). At size 1 the plan is the whole model and `SingleRank`'s collectives are the
identity, so TP=1 computes exactly what it did before sharding existed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from pdserve.kernels.ops import AttentionOps
from pdserve.shared.model.model_config import ModelConfig


class Collectives(Protocol):
    """The collectives the model calls; one implementation per process group, chosen at construction."""

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the ranks in place and returns it (the same values on every rank)."""

    def all_reduce_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, ops: AttentionOps
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, E] this rank's partial sum, residual: [T, E] -> (normed, residual): residual += the sum of
        x over the ranks (in place), then `ops.add_rms_norm`'s RMSNorm of it by weight [E]. This default is
        all_reduce then `ops.add_rms_norm`; a group with a fused kernel overrides it."""
        return ops.add_rms_norm(self.all_reduce(x), residual, weight, eps)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """local: [S, V/N] this rank's vocabulary columns -> [S, V_padded] on rank 0 (columns in rank
        order); other ranks get `local` back and discard it (only rank 0 samples)."""

    def argmax_tokens(self, best: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """best: [S] fp32 this rank's largest logit per row, index: [S] int64 its global vocabulary id ->
        [S] int64 the id of the largest over every rank (a tie to the lowest id: torch's argmax over the
        whole row), on every rank. What moves is [S, 2] per rank instead of [S, V / N]."""


def best_of_ranks(pairs: torch.Tensor) -> torch.Tensor:
    """pairs: [N, S, 2] float64 (value, global id) of each rank's best per row, ranks in vocabulary order ->
    [S] int64 the winning ids. argmax over ranks returns the first (lowest) rank among equal values, whose
    id is the lowest since each rank's id is its first maximum; float64 holds fp32 values and ids exactly."""
    winner = pairs[:, :, 0].argmax(dim=0)  # [S] rank
    return pairs[:, :, 1].gather(0, winner[None])[0].long()  # [S]


class SingleRank(Collectives):
    """The collectives of a group of one: nothing to exchange."""

    rank = 0
    size = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        return local

    def argmax_tokens(self, best: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return index


@dataclass(frozen=True)
class RowSlice:
    """Rows [start, stop) of dimension `dim` of a checkpoint tensor: the part one rank reads."""

    dim: int
    start: int
    stop: int

    def along(self, dim: int) -> RowSlice:
        """The same range of dimension `dim` (a column-parallel weight's rows are its row-parallel partner's
        columns)."""
        return RowSlice(dim, self.start, self.stop)


@dataclass(frozen=True)
class TPPlan:
    """One rank's share of the model (counts are per rank)."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    kv_head_start: int
    intermediate_size: int
    vocab_rows: int
    """ceil(V / N): rows of the embedding and LM head on every rank (the last rank's tail is padding)."""
    vocab_start: int
    vocab_size: int
    """Of the whole model."""
    head_dim: int
    expert_intermediate_size: int = 0
    """This rank's columns of each routed expert's intermediate dim (0: a dense model)."""
    shared_expert_intermediate_size: int = 0

    @property
    def qkv_size(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def _share(self, per_rank: int) -> RowSlice:
        """This rank's rows of a dimension split evenly, `per_rank` rows to each rank in rank order."""
        return RowSlice(0, self.rank * per_rank, (self.rank + 1) * per_rank)

    def q_rows(self) -> RowSlice:
        return self._share(self.num_heads * self.head_dim)

    def kv_rows(self) -> RowSlice:
        d = self.head_dim
        return RowSlice(0, self.kv_head_start * d, (self.kv_head_start + self.num_kv_heads) * d)

    def ffn_rows(self) -> RowSlice:
        return self._share(self.intermediate_size)

    def expert_rows(self) -> RowSlice:
        """This rank's rows of each expert's gate and up projections (column-parallel); `.along(1)`: its
        columns of the expert's down projection (row-parallel)."""
        return self._share(self.expert_intermediate_size)

    def shared_expert_rows(self) -> RowSlice:
        return self._share(self.shared_expert_intermediate_size)

    def vocab(self) -> RowSlice:
        """This rank's real vocabulary rows (fewer than `vocab_rows` on a padded last rank)."""
        return RowSlice(0, self.vocab_start, min(self.vocab_size, self.vocab_start + self.vocab_rows))


def plan(cfg: ModelConfig, rank: int, size: int) -> TPPlan:
    """Rank `rank`'s share of `cfg` at tensor-parallel size `size`; ValueError for an inexact split."""
    check_split(cfg, size)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside [0, {size})")
    heads = cfg.num_heads // size
    if cfg.num_kv_heads >= size:
        kv_heads, kv_start = cfg.num_kv_heads // size, rank * (cfg.num_kv_heads // size)
    else:  # replicated: the KV head of this rank's query heads (group of Hq / Hkv query heads per KV head)
        kv_heads, kv_start = 1, rank * heads // (cfg.num_heads // cfg.num_kv_heads)
    vocab_rows = -(-cfg.vocab_size // size)
    return TPPlan(
        rank=rank,
        size=size,
        num_heads=heads,
        num_kv_heads=kv_heads,
        kv_head_start=kv_start,
        intermediate_size=cfg.intermediate_size // size,
        vocab_rows=vocab_rows,
        vocab_start=rank * vocab_rows,
        vocab_size=cfg.vocab_size,
        head_dim=cfg.head_dim,
        expert_intermediate_size=0 if cfg.moe is None else cfg.moe.intermediate_size // size,
        shared_expert_intermediate_size=0
        if cfg.moe is None
        else cfg.moe.shared_expert_intermediate_size // size,
    )


def check_split(cfg: ModelConfig, size: int) -> None:
    """ValueError, one line naming the model's heads and the size, unless `cfg` splits exactly over `size`
    ranks (see the module's invariants)."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size={size}: must be >= 1")
    hq, hkv = cfg.num_heads, cfg.num_kv_heads
    if hq % size:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the model's {hq} query heads "
            f"({hkv} KV heads): use a size that divides {hq}"
        )
    if hkv % size and size % hkv:
        raise ValueError(
            f"tensor_parallel_size={size} neither divides nor is a multiple of the model's {hkv} KV heads "
            f"({hq} query heads)"
        )
    if cfg.intermediate_size % size:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the model's intermediate size "
            f"{cfg.intermediate_size}"
        )
    if cfg.moe is not None:
        for what, width in (("expert", cfg.moe.intermediate_size),
                            ("shared expert", cfg.moe.shared_expert_intermediate_size)):  # fmt: skip
            if width % size:
                raise ValueError(
                    f"tensor_parallel_size={size} does not divide the model's {what} intermediate size "
                    f"{width}: use a size that divides it"
                )


class WeightSource(Protocol):
    """A checkpoint's Hugging Face-named tensors, read one at a time and only the part a rank asks for (a
    safetensors file reads just those bytes of its memory map)."""

    def names(self) -> frozenset[str]:
        """Every tensor the checkpoint holds."""

    def read(self, name: str, part: RowSlice | None) -> torch.Tensor:
        """Tensor `name`, or rows `part` of it (None: whole); KeyError if it is not in `names()`."""


def narrow(tensor: torch.Tensor, part: RowSlice | None) -> torch.Tensor:
    """`part` of a tensor already in memory (a view; the whole tensor for None)."""
    return tensor if part is None else tensor.narrow(part.dim, part.start, part.stop - part.start)
