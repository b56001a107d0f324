"""The op interface the model calls (attention, and the fused elementwise ops between its matrix
products), and the per-step metadata it reads.

Implementations (torch reference, Triton) are chosen once by device in `get_ops`; model code never
branches on the backend. KV layout, one tensor per layer:
    kv_layer: [2, num_blocks, block_size, num_kv_heads, head_dim]   (index 0 = K, 1 = V)
A token's slot is `block_id * block_size + offset`; slot -1 means "do not write".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Batch layout of one forward step over T query tokens from S sequences.

    Sequence s owns query tokens [query_start_loc[s], query_start_loc[s+1]); those are the last
    q_len_s tokens of its context of seq_lens[s] tokens (cached prefix + new), so query token i of
    sequence s sits at position seq_lens[s] - q_len_s + i and attends causally to positions <= it.
    """

    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [S+1] int32, on the compute device
    seq_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, max_blocks] int32; entries past a sequence's blocks are ignored
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_decode(self) -> bool:
        """Every sequence contributes exactly one query token."""
        return self.max_query_len == 1


class AttentionOps(Protocol):
    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """key/value: [T, Hkv, D]; writes token t into slot slot_mapping[t] (skips -1)."""

    def prefill_attention(
        self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """q: [T, Hq, D] -> [T, Hq, D]; causal over each sequence's paged context (varlen batch)."""

    def decode_attention(
        self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """q: [S, Hq, D] (one token per sequence) -> [S, Hq, D]."""

    def gather_blocks(self, kv_layer: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Copy blocks into a contiguous buffer. block_ids: [n] int64; out: [2, n, block_size, Hkv, D]."""

    def scatter_blocks(self, src: torch.Tensor, kv_layer: torch.Tensor, block_ids: torch.Tensor) -> None:
        """Inverse of gather_blocks: src [2, n, block_size, Hkv, D] into the blocks named by block_ids."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: [T, E] -> [T, E] in x's dtype: normalised in fp32, rounded, then scaled by weight [E]."""

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual: [T, E]. residual += x in place (rounded to its dtype); returns
        (rms_norm(residual), residual)."""

    def rope_write_kv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_layer: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_heads: int,
    ) -> torch.Tensor:
        """Rotate-half RoPE in fp32, then the KV write. qkv: [T, (Hq + 2 Hkv) * D] (q | k | v heads);
        positions: [T] int64 rows of cos, sin: [P, D/2] fp32 (every position < P). Rotates q in place in
        qkv and writes rotated k and v to slot slot_mapping[t] (skips -1); qkv's k and v columns are left
        as they were. Returns q: [T, Hq, D], a view of qkv."""

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [T, 2F] (gate | up) -> silu(gate) * up: [T, F], silu rounded before the product."""


def check_kv_layer(kv_layer: torch.Tensor) -> None:
    assert kv_layer.dim() == 5 and kv_layer.shape[0] == 2, (
        f"kv_layer must be [2,N,B,H,D], got {kv_layer.shape}"
    )
    assert kv_layer.is_contiguous(), "kv_layer must be contiguous"


def get_ops(device: torch.device) -> AttentionOps:
    """The fastest correct implementation for `device`: Triton on CUDA, the torch reference elsewhere."""
    if device.type == "cuda":
        from pdserve.kernels.triton_ops import TritonOps

        return TritonOps()
    from pdserve.kernels.reference import ReferenceOps

    return ReferenceOps()
