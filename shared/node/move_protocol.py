"""The messages of a drain that keeps the cache (`kvctl drain NODE --move-prefixes`), node protocol version 3
(the codec of shared/node/node_protocol.py; these messages travel only between kvctl and nodes).

Endpoints, on every node, each needing the cluster's credential: `POST /internal/hot-prefixes` (body
HotPrefixesRequest; reply HotPrefixes: the node's hottest cached prefix chains up to a byte budget),
`POST /internal/pull-prefix` (body PullPrefix; reply PullResult: the node fetched the chain from the holder
through the prefix-fetch path, node/kv_fetch.py, and keeps it cached), and `POST /internal/drain` whose body
may be a DrainNote (what the move did, for the draining node's log line, and `migrate`: whether its running
requests move with their KV, `kvctl drain --migrate`) or `{}` (a plain drain).
Invariants: block hashes are 32 bytes; a chain's hashes are leading prompt blocks in order; sizes are bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.shared.node.node_protocol import CODEC
from pdserve.shared.types import NodeId
from pdserve.shared.wire import JsonMessage


class _Message(JsonMessage):
    codec = CODEC


def _check_hashes(hashes: tuple[bytes, ...]) -> None:
    if not hashes or any(len(h) != 32 for h in hashes):
        raise ValueError("block_hashes must be a non-empty list of 32-byte hashes")


@dataclass(frozen=True)
class HotPrefixesRequest(_Message):
    budget_bytes: int

    def __post_init__(self) -> None:
        if self.budget_bytes < 0:
            raise ValueError(f"budget_bytes={self.budget_bytes} must be >= 0")


@dataclass(frozen=True)
class HotPrefix:
    """One cached prefix chain: its leading block hashes the node holds, hits, seconds since the last hit."""

    block_hashes: tuple[bytes, ...]
    hits: int
    idle_s: float

    def __post_init__(self) -> None:
        _check_hashes(self.block_hashes)


@dataclass(frozen=True)
class HotPrefixes(_Message):
    """The chains, hottest first (more hits, then the more recent), sharing at most the budget's blocks."""

    node_id: NodeId
    block_size: int
    block_bytes: int
    """KV bytes of one block (every layer and KV head): what moving it moves."""
    chains: tuple[HotPrefix, ...]


@dataclass(frozen=True)
class PullPrefix(_Message):
    """kvctl -> the node that should hold a chain next: fetch it from `holder_url` (the draining node)."""

    holder_node_id: NodeId
    holder_url: str
    block_hashes: tuple[bytes, ...]
    deadline: float
    """Absolute unix seconds: the fetch gives up past it."""

    def __post_init__(self) -> None:
        _check_hashes(self.block_hashes)
        if not self.holder_url:
            raise ValueError("holder_url is empty")


@dataclass(frozen=True)
class PullResult(_Message):
    """What a pull did: of `asked_blocks`, `local_blocks` were already here, `landed_blocks` came over
    (`bytes_moved` bytes); `error` says why nothing (or less) came: no room, the fetch failed."""

    asked_blocks: int
    local_blocks: int
    landed_blocks: int
    bytes_moved: int
    error: str | None = None
    no_room: bool = False


@dataclass(frozen=True)
class DrainNote(_Message):
    """kvctl -> the draining node: what moving its prefixes did, for its log line, and whether to move its
    running requests with their KV (node/drain_migrate.py)."""

    moved_prefixes: int = 0
    moved_bytes: int = 0
    why_not: str | None = None
    """Why nothing was moved (the drain degraded to a plain drain); None when something was, or no move of
    prefixes was asked for."""
    migrate: bool = False
    """End each running request that can move with a migration signal: the router continues it on another
    node, which fetches its KV (prompt and generated tokens) from this one instead of prefilling it."""
