"""The op interface the model calls (attention, and the fused elementwise ops between its matrix
products), and the per-step metadata it reads.

Implementations (torch reference, Triton) are chosen once by device in `get_ops`; model code never
branches on the backend. KV layout, one tensor per layer:
    kv_layer: [2, num_blocks, block_size, num_kv_heads, head_dim]   (index 0 = K, 1 = V)
A token's slot is `block_id * block_size + offset`; slot -1 means "do not write".

An FP8 cache (float8_e4m3fn) holds K and V at a fixed scale of 1.0 in every layer, as vLLM does without
calibration: a value is saturated to +-448 and rounded on write (`to_kv`), and widened to the compute dtype
where it is read (`from_kv`, in registers in the Triton kernels). A fixed scale needs no agreement between
the nodes that exchange blocks, and stays valid for a block's whole life in any tier; a dynamic one would
make a block's bytes mean different things on P and D. K and V of the Llama family sit far inside +-448
(after RMSNorm and RoPE), where e4m3's 3 mantissa bits bound the error relative to each value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

FP8_KV_DTYPES = (torch.float8_e4m3fn,)


def to_kv(x: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """x in the cache's dtype: saturated to the FP8 range first for an FP8 cache (a cast alone may give
    NaN past it), a plain cast otherwise."""
    if kv_dtype in FP8_KV_DTYPES:
        fp8_max = torch.finfo(kv_dtype).max
        return x.float().clamp(-fp8_max, fp8_max).to(kv_dtype)
    return x.to(kv_dtype)


def from_kv(kv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache values to compute with: an FP8 cache's widened to `dtype` (scale 1.0), others as stored."""
    return kv.to(dtype) if kv.dtype in FP8_KV_DTYPES else kv


@dataclass(frozen=True)
class RopeTables:
    """Rotate-half RoPE's tables, cos and sin: [P, D/2] fp32 each, row p for position p (every position a
    step uses is < P). Checked once here, where they are built, rather than at every layer's call."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __post_init__(self) -> None:
        for name, table in (("cos", self.cos), ("sin", self.sin)):
            assert table.dtype == torch.float32 and table.dim() == 2, (
                f"RoPE {name} must be fp32 [P, D/2], got {table.dtype} {tuple(table.shape)}"
            )
        assert self.cos.shape == self.sin.shape and self.cos.device == self.sin.device, (
            f"RoPE cos {tuple(self.cos.shape)} on {self.cos.device} and sin {tuple(self.sin.shape)} on "
            f"{self.sin.device} differ"
        )
        assert self.cos.is_contiguous() and self.sin.is_contiguous(), "RoPE tables must be contiguous"

    @classmethod
    def from_inv_freq(cls, inv_freq: torch.Tensor, max_positions: int, device: torch.device) -> RopeTables:
        """inv_freq: [D/2] fp32 inverse frequencies -> the tables of positions 0..max_positions-1."""
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, D/2]
        return cls(angles.cos().to(device), angles.sin().to(device))


@dataclass(frozen=True)
class AttentionMetadata:
    """What every layer of one forward step over T query tokens from S sequences reads besides its own
    weights and KV: built once per step (the CUDA-graph path builds it once, over its static buffers).

    Sequence s owns query tokens [query_start_loc[s], query_start_loc[s+1]); those are the last
    q_len_s tokens of its context of seq_lens[s] tokens (cached prefix + new), so query token i of
    sequence s sits at position seq_lens[s] - q_len_s + i and attends causally to positions <= it.
    """

    positions: torch.Tensor  # [T] int64, each query token's position: its row of the RoPE tables
    slot_mapping: torch.Tensor  # [T] int64, where its K and V go (-1: nowhere)
    query_start_loc: torch.Tensor  # [S+1] int32, on the compute device
    seq_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, max_blocks] int32; entries past a sequence's blocks are ignored
    max_query_len: int
    max_seq_len: int
    rope: RopeTables  # the model's, the same every step

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_decode(self) -> bool:
        """Every sequence contributes exactly one query token."""
        return self.max_query_len == 1


@dataclass(frozen=True)
class QKNorm:
    """Qwen3's per-head RMSNorm of q and k before RoPE: q heads scaled by q_weight [D], k heads by
    k_weight [D], each head normalised in fp32 and rounded before the weight multiply, as `rms_norm`."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float


class AttentionOps(Protocol):
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

    def scatter_layers(self, src: torch.Tensor, kv_layers: torch.Tensor, block_ids: torch.Tensor) -> None:
        """scatter_blocks for consecutive layers at once (a transfer frame): src [nl, 2, n, block_size, Hkv,
        D] into kv_layers [nl, 2, N, block_size, Hkv, D], a slice of the layer-stacked cache."""

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
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        num_heads: int,
        qk_norm: QKNorm | None = None,
    ) -> torch.Tensor:
        """Rotate-half RoPE in fp32 at meta.positions, then the KV write. qkv: [T, (Hq + 2 Hkv) * D]
        (q | k | v heads). With `qk_norm`, q and k heads are normalised first (one launch for all on GPU).
        Writes rotated k and v to slot meta.slot_mapping[t] (skips -1); qkv's k and v columns are left as
        they were. Returns the rotated q: [T, Hq, D], laid out as the implementation's attention reads it
        (Triton: rotated in place, a view of qkv; the CPU reference: its own head-major buffer)."""

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
