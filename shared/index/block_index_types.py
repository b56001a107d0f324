"""Plain data of the block index (docs/redis_index.md): connection settings, node registration, load, errors.

Invariants:
- The records Redis stores (NodeInfo, NodeLoad) are frozen dataclasses in the one codec's versioned JSON
  (shared/wire.py, no pickle); `from_json(to_json(x)) == x` for each of them.
- A `NodeInfo`'s fingerprint and its credential digest are 64 hex digits each; its kv_layout is the engine's
  `KVLayout`, of which the cluster record compares the fields of `KV_LAYOUT_FIELDS`.
- A node's record is trusted only with its signature (`RecordKey`, keyed from the cluster token): a record
  that is malformed or whose signature does not verify is an `InvalidRecord`, never a `NodeStatus`, and a
  `NodeStatus`'s draining flag is the one in the node's signed load.
- Nothing here does I/O; `block_index.py` owns the Redis side.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

import numpy as np
from pdserve.shared.index.redis_url import address, check_url
from pdserve.shared.types import ROLES, BlockHash, KVLayout, NodeId, Role
from pdserve.shared.wire import Codec, JsonMessage

CODEC = Codec("index record", 1)
_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]+")
_HEX64_RE = re.compile(r"[0-9a-f]{64}")


class RecordKey(Protocol):
    """Signs and verifies node records (shared/node/node_sign.py's ClusterKeys)."""

    def sign_record(self, parts: Sequence[bytes]) -> str: ...

    def verify_record(self, parts: Sequence[bytes], signature: str) -> bool: ...


class BlockIndexError(Exception):
    """Base of every error the block index raises."""


class IndexUnavailable(BlockIndexError):
    """Redis cannot be reached (or refused us): the router falls back to load-only routing."""


class IndexAuthError(IndexUnavailable):
    """Redis refused the credentials (AUTH) or requires some and none were given."""


class IncompatibleNode(BlockIndexError):
    """A node's credential, protocol version, KV layout or fingerprint differs from the cluster's recorded
    ones."""


class StaleEpoch(BlockIndexError):
    """A write carried an epoch that is not the node's current one in the index (`current`): higher, the
    node registered again since (another process of it); lower, the index lost the node's last
    registration (a failover to a replica that had not received it, an old append-only file)."""

    def __init__(self, message: str, current: int) -> None:
        super().__init__(message)
        self.current = current


class NodeNotRegistered(BlockIndexError):
    """The node has no registration (never registered, deregistered, Redis lost its data): register again."""


@dataclass(frozen=True)
class RedisConfig:
    """How to reach the index's Redis and which cluster's keys to use.

    url (redis://, rediss://, unix://, or redis+sentinel:// for a Sentinel group: shared/index/redis_url.py)
    wins over host/port/db when given; credentials and TLS files given here are added to it.
    Every key of one cluster starts with `pdserve:{<cluster>}:` (one hash tag: a Redis Cluster would keep
    them in one slot, as the Lua scripts need; redis+cluster:// is refused all the same, docs/redis_index.md).
    """

    url: str | None = None
    host: str = "127.0.0.1"
    port: int = 6379
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_verify: bool = True
    cluster: str = "default"
    heartbeat_ttl_s: float = 10.0
    """A node whose last heartbeat is older than this stops counting (nodes and lookups)."""
    records_ttl_s: float = 300.0
    """The block records of a node whose heartbeats stopped are deleted by Redis after this."""
    socket_timeout_s: float = 2.0
    max_connections: int = 64

    def __post_init__(self) -> None:
        if self.url is not None:
            check_url(self.url)
        if not 0 < self.port < 65536:
            raise ValueError(f"port={self.port}: must be in 1..65535")
        if not _NAME_RE.fullmatch(self.cluster):
            raise ValueError(f"cluster={self.cluster!r}: use letters, digits, '_', '.', '-'")
        if self.heartbeat_ttl_s <= 0:
            raise ValueError(f"heartbeat_ttl_s={self.heartbeat_ttl_s}: must be positive")
        if self.records_ttl_s < self.heartbeat_ttl_s:
            raise ValueError(f"records_ttl_s={self.records_ttl_s}: must be >= heartbeat_ttl_s")
        if self.socket_timeout_s <= 0 or self.max_connections < 1:
            raise ValueError(
                f"socket_timeout_s={self.socket_timeout_s}, max_connections={self.max_connections}: "
                "must be positive"
            )

    @property
    def prefix(self) -> str:
        return f"pdserve:{{{self.cluster}}}:"

    @property
    def address(self) -> str:
        """Where Redis is, for messages: never contains the password."""
        if self.url is None:
            return f"{'rediss' if self.tls else 'redis'}://{self.host}:{self.port}/{self.db}"
        return address(self.url)


class _Record(JsonMessage):
    """A record Redis stores."""

    codec = CODEC


QUANTIZATIONS = ("none", "fp8")
"""What `NodeInfo.quantization` may say."""


@dataclass(frozen=True)
class NodeInfo(_Record):
    """A node's registration. epoch is assigned by `BlockIndex.register` (0 before)."""

    node_id: NodeId
    role: Role
    http_url: str
    transfer_addr: str
    model_fingerprint: str
    """64 lowercase hex digits: shared.engine.block_hash.model_fingerprint(...).hex()."""
    kv_layout: KVLayout
    protocol_version: int
    capacity_blocks: int
    credential_digest: str
    """64 lowercase hex digits: node_auth.credential_digest(the KV-transfer token); never the token."""
    max_model_len: int
    """The longest context (prompt + output tokens) the node serves; the router's limit for its requests."""
    epoch: int = 0
    tokenizer_fingerprint: str = ""
    """64 lowercase hex digits: shared.tokenizer.Tokenizer.fingerprint ("" from a node that predates it)."""
    model: str = ""
    """What the node serves, for operators: `<architecture> <checkpoint name>` ("" from an older node)."""
    quantization: str = "none"
    """The weights' quantization: "fp8" (shared/model/fp8.py) or "none" (the model dtype; a node that
    predates the field)."""
    devices: tuple[str, ...] = ()
    """The device of each tensor-parallel rank, rank 0 first (`kv_layout.tp_size` of them; () from a node
    that predates it)."""
    max_num_seqs: int = 0
    """The most requests the node's engine runs at once (--max-num-seqs): with capacity_blocks, what bounds
    its concurrent decodes (0 from a node that predates it)."""

    def __post_init__(self) -> None:
        if not _NAME_RE.fullmatch(self.node_id):
            raise ValueError(f"node_id={self.node_id!r}: use letters, digits, '_', '.', '-'")
        if self.role not in ROLES:
            raise ValueError(f"role={self.role!r}: accepted {list(ROLES)}")
        if not _HEX64_RE.fullmatch(self.model_fingerprint):
            raise ValueError(f"model_fingerprint={self.model_fingerprint!r}: need 64 lowercase hex digits")
        if not _HEX64_RE.fullmatch(self.credential_digest):
            raise ValueError(f"credential_digest={self.credential_digest!r}: need 64 lowercase hex digits")
        if self.tokenizer_fingerprint and not _HEX64_RE.fullmatch(self.tokenizer_fingerprint):
            raise ValueError(
                f"tokenizer_fingerprint={self.tokenizer_fingerprint!r}: need 64 lowercase hex digits or ''"
            )
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={self.quantization!r}: accepted {list(QUANTIZATIONS)}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len={self.max_model_len}: must be >= 1")
        if min(self.capacity_blocks, self.protocol_version, self.epoch, self.max_num_seqs) < 0:
            raise ValueError(
                f"capacity_blocks={self.capacity_blocks}, protocol_version={self.protocol_version}, "
                f"epoch={self.epoch}, max_num_seqs={self.max_num_seqs}: must be >= 0"
            )

    @property
    def block_size(self) -> int:
        return self.kv_layout.block_size


@dataclass(frozen=True)
class NodeLoad(_Record):
    """What a node reports with each heartbeat. Counts are of requests and of KV blocks."""

    running: int
    waiting: int
    kv_used_blocks: int
    kv_total_blocks: int
    blocks_held: int
    """Full blocks the node holds with a hash (in use or cached-free): what the index should list."""
    draining: bool = False
    queued_prefill_tokens: int = 0
    """Prompt tokens still to compute over the node's waiting and running requests."""

    def __post_init__(self) -> None:
        counts = asdict(self)
        del counts["draining"]
        bad = {k: v for k, v in counts.items() if v < 0}
        if bad:
            raise ValueError(f"NodeLoad counts must be >= 0, got {bad}")


@dataclass(frozen=True)
class NodeStatus:
    """A live node as `BlockIndex.nodes()` sees it, its record verified. heartbeat_age_s is measured on
    Redis's clock; draining is its signed load's."""

    info: NodeInfo
    load: NodeLoad | None
    heartbeat_age_s: float
    draining: bool
    blocks_indexed: int
    """Block records of the current epoch in the index (compare with load.blocks_held for staleness)."""

    def to_dict(self) -> dict[str, object]:
        """Its JSON form, as `kvctl nodes --json` prints it."""
        return CODEC.fields(self)


@dataclass(frozen=True)
class InvalidRecord:
    """A node record the index holds but nobody may act on: malformed, unsigned, or signed with another key
    (written by someone without the cluster's credential). `epoch` is as Redis holds it."""

    node_id: str
    epoch: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"node_id": self.node_id, "epoch": self.epoch, "reason": self.reason}


@dataclass(frozen=True)
class NodeListing:
    """What `BlockIndex.listing()` reads: the live nodes whose records verify, sorted by id, and the rest."""

    live: list[NodeStatus]
    invalid: list[InvalidRecord]


@dataclass(frozen=True)
class NodeBlocks:
    """One node's block records: their count and up to `limit` of the hashes."""

    count: int
    hashes: tuple[BlockHash, ...] = field(default=())
    host: int = 0
    """Of `count`, the blocks in the node's host-memory tier."""


@dataclass(frozen=True)
class BlocksDigest:
    """An order-free digest of a set of block hashes: its size and the XOR of each hash's first two
    little-endian int32 words (wrapped to unsigned). The index keeps one per node's records, updated by every
    script that changes them (block_index_scripts.py); a node folds its held set the same way. Equal digests
    mean equal sets but for a 2**-64 chance (SHA-256 hashes are uniform)."""

    count: int
    a: int
    b: int

    @classmethod
    def of(cls, hashes: Sequence[BlockHash]) -> BlocksDigest:
        if not hashes:
            return cls(0, 0, 0)
        words = np.frombuffer(b"".join(h[:8] for h in hashes), dtype="<u4").reshape(-1, 2)  # [n, 2]
        a, b = np.bitwise_xor.reduce(words, axis=0)
        return cls(len(hashes), int(a), int(b))

    @classmethod
    def from_reply(cls, count: int, a: int, b: int) -> BlocksDigest:
        """From the scripts' signed int32 words."""
        return cls(count, a & 0xFFFFFFFF, b & 0xFFFFFFFF)


@dataclass(frozen=True)
class HitStats:
    """Prefix-cache outcome of prompt tokens, in tokens: computed-locally-cached, fetched, computed."""

    local_tokens: int = 0
    remote_tokens: int = 0
    miss_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.local_tokens + self.remote_tokens + self.miss_tokens

    def __add__(self, other: HitStats) -> HitStats:
        return HitStats(
            self.local_tokens + other.local_tokens,
            self.remote_tokens + other.remote_tokens,
            self.miss_tokens + other.miss_tokens,
        )
