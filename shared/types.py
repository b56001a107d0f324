"""Identifier types and the small contracts shared by every component, each defined here once.

Distinct types for distinct identifiers (STYLE.md habit 4): a block's chained hash is not a block id,
and a request id is not a node id. All are plain values at run time.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal, NewType

BlockHash = NewType("BlockHash", bytes)
"""32-byte SHA-256 chained hash of a full KV block (docs/block_hash.md)."""

BlockId = NewType("BlockId", int)
"""Index of a block in one node's preallocated KV tensor (0 <= id < num_blocks)."""

RequestId = NewType("RequestId", str)
NodeId = NewType("NodeId", str)

Role = Literal["prefill", "decode", "single"]
"""What a node does: prefill (computes prompts and sends their KV), decode (receives KV and generates), or
single (both, on its own)."""
ROLES: tuple[Role, ...] = ("prefill", "decode", "single")

FinishReason = Literal["stop", "length", "abort", "error"]
"""Why a request ended: a stop condition, max_tokens or the context, an abort (client gone, cancelled), or a
failure (engine, transfer, deadline)."""
FINISH_REASONS: tuple[FinishReason, ...] = ("stop", "length", "abort", "error")


class KVSource(StrEnum):
    """Where a prompt token's KV came from for one request: the one vocabulary (the `kind` label) of every
    prefix-hit count, the router's, the prefill node's and the decode node's. Counts are in tokens."""

    LOCAL = "local"
    """The node's own prefix cache (any tier): a hit in vLLM's sense (`vllm:prefix_cache_hits`)."""
    REMOTE = "remote"
    """Fetched for this request from another node that held it (node/kv_fetch.py)."""
    TRANSFERRED = "transferred"
    """Sent by the prefill node that computed (or held) it: the decode node's side of a P/D request."""
    MISS = "miss"
    """Computed by the node."""


KV_DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
"""The KV cache dtypes (torch's names) and their element sizes in bytes."""


@dataclass(frozen=True)
class KVLayout:
    """A node's KV blocks as they travel: `[num_layers, 2, block_size, num_kv_heads, head_dim]` per block,
    every KV head of the model in the model's order, whatever the node's tensor-parallel size.

    `tp_size` is how many ranks hold the node's pool (each rank its share of the heads; rank 0 gathers and
    scatters them, shared/engine/parallel/kv_pools.py); it is stated, not compared: two nodes exchange KV,
    and share a cluster, when the fields of `KV_LAYOUT_FIELDS` are equal, at any pair of sizes.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    tp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in KV_DTYPE_BYTES:
            raise ValueError(f"KVLayout.dtype {self.dtype!r} is not one of {sorted(KV_DTYPE_BYTES)}")

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of K and V of one block in one layer."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * KV_DTYPE_BYTES[self.dtype]

    def describe(self) -> str:
        """The model's KV layout in one phrase: `30 layers x 3 KV heads x 64, block 16, bfloat16`."""
        return (
            f"{self.num_layers} layers x {self.num_kv_heads} KV heads x {self.head_dim}, block "
            f"{self.block_size}, {self.dtype}"
        )

    @classmethod
    def from_fields(cls, values: dict[str, str]) -> KVLayout:
        """The layout of `KV_LAYOUT_FIELDS` given as strings (the index's cluster record), at TP 1."""
        v = values
        return cls(
            int(v["num_layers"]), int(v["num_kv_heads"]), int(v["head_dim"]), int(v["block_size"]), v["dtype"]
        )

    def first_difference(self, other: KVLayout) -> str | None:
        """`"field: local X, peer Y (local <layout>; peer <layout>)"` for the first differing field of
        `KV_LAYOUT_FIELDS`, or None when the blocks of the two layouts map onto each other."""
        for name in KV_LAYOUT_FIELDS:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return (
                    f"{name}: local {mine!r}, peer {theirs!r} (local {self.describe()} at TP "
                    f"{self.tp_size}; peer {other.describe()} at TP {other.tp_size})"
                )
        return None


KV_LAYOUT_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype")
"""The fields of a KVLayout two nodes must share to exchange blocks (and every node of a cluster shares, the
index's cluster record holds them): the model's KV layout. `tp_size` may differ."""


@dataclass(frozen=True)
class FirstToken:
    """The token a prefill node sampled for a prompt, handed to the decode node with the prompt's KV (the
    transfer's COMPLETE): its id and, when the request asked for logprobs, its logprob and the top
    alternatives as (token id, logprob), most likely first."""

    token_id: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if self.token_id < 0:
            raise ValueError(f"FirstToken.token_id must be >= 0, got {self.token_id}")
        if self.logprob is None and self.top:
            raise ValueError("FirstToken.top given without its logprob")
