"""Identifier types and the small contracts shared by every component, each defined here once.

Distinct types for distinct identifiers (STYLE.md habit 4): a block's chained hash is not a block id,
and a request id is not a node id. All are plain values at run time.
"""

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
