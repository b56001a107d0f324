"""Identifier types shared by every component.

Distinct types for distinct identifiers (STYLE.md habit 4): a block's chained hash is not a block id,
and a request id is not a node id. All are plain values at run time.
"""

from typing import NewType

BlockHash = NewType("BlockHash", bytes)
"""32-byte SHA-256 chained hash of a full KV block (docs/block_hash.md)."""

BlockId = NewType("BlockId", int)
"""Index of a block in one node's preallocated KV tensor (0 <= id < num_blocks)."""

RequestId = NewType("RequestId", str)
NodeId = NewType("NodeId", str)
