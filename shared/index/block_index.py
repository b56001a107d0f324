"""The Redis block index and node registry (DESIGN.md contract 2; schema in docs/redis_index.md).

Owns every Redis key under `RedisConfig.prefix`. Invariants (the Lua scripts keep them atomically):
- A node counts (in `nodes()` and `lookup()`) only while its heartbeat key is alive and carries its current
  epoch; records of older epochs are never read and are deleted on re-registration or by their TTL.
- Nodes of one cluster share one credential digest, model fingerprint, tokenizer fingerprint, KV layout and
  protocol version while any of them is live; a node that differs is refused with `IncompatibleNode` naming
  the field and both values (for the credential, a prefix of each digest).
- `lookup` is one EVALSHA whatever the prompt length, and reads only.
- The index is an estimate for routing: a block it lists may have been evicted; the transfer verifies.
- Redis is not trusted with what a node is: a node's heartbeat writes its load (drain flag included) with a
  signature over (node id, registration JSON, epoch, load JSON) made with the cluster's record key, and
  `listing()` returns as live only records whose signature verifies; the rest, malformed ones included, are
  listed as invalid (never raised: one bad record never hides the others). A registration is not live
  until its first signed heartbeat.
- A node's records list the blocks it holds in any tier; `blkhost:<id>:<epoch>` lists those of them that
  sit in its host-memory tier (BlockTiered events), kept beside the records with the same TTL.
At most `max_connections` calls run at once; the others wait for a connection (redis-py's pool would fail
them). Redis unreachable or unable to serve (OOM, read-only replica) raises `IndexUnavailable`; refused
credentials raise its subclass `IndexAuthError`. A call cancelled while redis-py sends a command (its
`asyncio.wait_for` swallows a cancellation that lands as the send completes, Python 3.11) raises
`CancelledError` when it returns: a cancelled caller is never left running.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, cast

import redis.asyncio as aioredis
import redis.exceptions as rexc
from pdserve.shared.engine.block_pool import BlockEvent, BlockRemoved, BlockStored, BlockTiered
from pdserve.shared.index import block_index_scripts as lua
from pdserve.shared.index.block_index_types import (
    BlocksDigest,
    HitStats,
    IncompatibleNode,
    IndexAuthError,
    IndexUnavailable,
    InvalidRecord,
    NodeBlocks,
    NodeInfo,
    NodeListing,
    NodeLoad,
    NodeNotRegistered,
    NodeStatus,
    RecordKey,
    RedisConfig,
    StaleEpoch,
)
from pdserve.shared.index.redis_url import SENTINEL_SCHEME, parse_sentinel, sentinel_client
from pdserve.shared.types import KV_LAYOUT_FIELDS, BlockHash, KVLayout, NodeId
from pdserve.shared.wire import WireError
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff


def connect(config: RedisConfig) -> aioredis.Redis:
    """An asyncio Redis client for config (AUTH and TLS settings honoured); connects lazily."""
    common: dict[str, Any] = {
        "username": config.username,
        "password": config.password,
        "socket_timeout": config.socket_timeout_s,
        "socket_connect_timeout": config.socket_timeout_s,
        "max_connections": config.max_connections,
        # One immediate retry covers a pooled connection Redis closed; the router needs a fast failure more
        # than redis-py's default of 3 retries with second-long backoff (it falls back to load-only routing).
        "retry": Retry(NoBackoff(), 1),
    }
    tls: dict[str, Any] = {
        "ssl_ca_certs": config.tls_ca_file,
        "ssl_certfile": config.tls_cert_file,
        "ssl_keyfile": config.tls_key_file,
        "ssl_cert_reqs": "required" if config.tls_verify else "none",
        "ssl_check_hostname": config.tls_verify,
    }
    if config.url is not None and config.url.startswith(SENTINEL_SCHEME + "://"):
        return sentinel_client(parse_sentinel(config.url), config.password, config.username, common)
    if config.url is not None:
        extra = tls if config.url.startswith("rediss://") else {}
        return aioredis.Redis.from_url(config.url, **common, **extra)
    extra = {"ssl": True, **tls} if config.tls else {}
    return aioredis.Redis(host=config.host, port=config.port, db=config.db, **common, **extra)


def _layout_pairs(info: NodeInfo) -> list[str]:
    """Fields a node must share with the cluster. The credential first: a node that cannot authenticate to
    its peers is refused whatever else matches. Then the most specific: the fingerprint covers the block
    size and KV dtype too, so checking the layout before it names the field that actually differs."""
    pairs = ["credential_digest", info.credential_digest, "protocol_version", str(info.protocol_version)]
    for name in KV_LAYOUT_FIELDS:
        pairs += [f"kv_layout.{name}", str(getattr(info.kv_layout, name))]
    if info.tokenizer_fingerprint:  # a node that predates it is not compared on it
        pairs += ["tokenizer_fingerprint", info.tokenizer_fingerprint]
    return [*pairs, "model_fingerprint", info.model_fingerprint]


def _event_args(events: Sequence[BlockEvent]) -> list[bytes | str | int]:
    args: list[bytes | str | int] = []
    for event in events:
        if isinstance(event, BlockStored):
            args += ["S", len(event.block_hashes), *event.block_hashes]
        elif isinstance(event, BlockRemoved):
            args += ["R", len(event.block_hashes), *event.block_hashes]
        elif not isinstance(event, BlockTiered):
            raise TypeError(f"publish takes block events, got {type(event).__name__}")
    return args


def _stored(info: NodeInfo) -> bytes:
    """The registration JSON Redis stores (the epoch lives in its own field)."""
    return dataclasses.replace(info, epoch=0).to_json()


def _signed_parts(node_id: bytes, info_json: bytes, epoch: bytes, load_json: bytes) -> list[bytes]:
    return [node_id, info_json, epoch, load_json]


class BlockIndex:
    """Async client of one cluster's block index. One per process; safe to share between tasks. `key` signs
    this process's heartbeats and verifies every record it reads."""

    def __init__(self, config: RedisConfig, key: RecordKey) -> None:
        self.config = config
        self._key = key
        self._redis = connect(config)
        self._p = config.prefix
        self._nodes_key = self._p + "nodes"
        self._hb_ms = int(config.heartbeat_ttl_s * 1000)
        self._records_ms = int(config.records_ttl_s * 1000)
        reg = self._redis.register_script
        self._register, self._heartbeat = reg(lua.REGISTER), reg(lua.HEARTBEAT)
        self._publish, self._lookup, self._nodes = reg(lua.PUBLISH), reg(lua.LOOKUP), reg(lua.NODES)
        self._deregister = reg(lua.DEREGISTER)
        self._evict = reg(lua.EVICT_RECORDS)
        self._digest, self._rebuild = reg(lua.DIGEST), reg(lua.REBUILD_DIGEST)
        # redis-py's pool fails a call at once when every connection is busy: calls queue here instead
        self._slots = asyncio.Semaphore(config.max_connections)

    async def close(self) -> None:
        await self._redis.aclose()

    async def __aenter__(self) -> BlockIndex:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @asynccontextmanager
    async def _guard(self, what: str) -> AsyncIterator[None]:
        where = self.config.address
        task = asyncio.current_task()
        cancels = task.cancelling() if task is not None else 0
        async with self._slots:
            try:
                yield
            except (rexc.AuthenticationError, rexc.AuthenticationWrongNumberOfArgsError) as exc:
                message = f"Redis at {where} refused the credentials during {what}: {exc}"
                raise IndexAuthError(message) from exc
            except rexc.NoPermissionError as exc:
                raise IndexAuthError(
                    f"Redis at {where} denied {what} to user {self.config.username}: {exc}"
                ) from exc
            except (rexc.ConnectionError, rexc.TimeoutError, OSError) as exc:
                raise IndexUnavailable(f"Redis at {where} is unreachable during {what}: {exc}") from exc
            except rexc.AskError as exc:  # MOVED or ASK: a Redis Cluster node without the index's slot
                raise IndexUnavailable(
                    f"Redis at {where} is a Redis Cluster node ({exc}): pdserve needs one primary holding "
                    "every key (a single server, or a Sentinel group: redis+sentinel://host:26379/mymaster)"
                ) from exc
            except rexc.RedisError as exc:  # OOM, READONLY replica, a busy script: Redis cannot serve
                raise IndexUnavailable(f"Redis at {where} failed {what}: {exc}") from exc
        if task is not None and task.cancelling() > cancels:
            raise asyncio.CancelledError(f"{what} was cancelled while Redis answered")

    async def _call(self, script: Any, what: str, *args: bytes | str | int) -> Any:
        async with self._guard(what):
            return await script(keys=[self._nodes_key], args=[self._p, *args])

    @staticmethod
    def _check(reply: list[Any], node_id: str, epoch: int | None = None) -> int:
        status = reply[0].decode()
        if status == "UNREGISTERED":
            raise NodeNotRegistered(f"node {node_id!r} is not registered in the index: register it again")
        if status == "STALE":
            current = int(reply[1])
            message = f"node {node_id!r}: epoch {epoch} is stale, the current epoch is {current}"
            raise StaleEpoch(message, current)
        return int(reply[1])

    # --- registry -------------------------------------------------------------------------------------------

    async def ping(self) -> None:
        async with self._guard("ping"):
            await self._redis.ping()

    async def register(self, info: NodeInfo, load: NodeLoad, after_epoch: int = 0) -> int:
        """Register (or re-register) a node and send its first signed heartbeat with `load` (its drain flag
        included, so a draining node that registers again never looks ready); returns its new epoch, above
        `after_epoch` (the node's previous one: Redis may have lost the counter). Refuses an incompatible
        node (IncompatibleNode)."""
        reply = await self._call(
            self._register,
            "register",
            info.node_id,
            _stored(info),
            self._records_ms,
            after_epoch,
            *_layout_pairs(info),
        )
        if reply[0] == b"INCOMPATIBLE":
            field, mine, recorded = (v.decode() for v in reply[1:4])
            if field == "credential_digest":
                raise IncompatibleNode(
                    f"node {info.node_id!r} refused by cluster {self.config.cluster!r}: credential mismatch, "
                    "its KV-transfer token (PDSERVE_AUTH_TOKEN or --auth-token-file) differs from the live "
                    f"nodes' (token digests {mine[:12]}... vs {recorded[:12]}...)"
                )
            layouts = ""
            if field.startswith("kv_layout."):  # name both layouts: the operator sees which model differs
                theirs = KVLayout.from_fields(
                    {k.removeprefix("kv_layout."): v for k, v in (await self.cluster_record()).items()}
                )
                layouts = f" (node: {info.kv_layout.describe()}; live nodes: {theirs.describe()})"
            raise IncompatibleNode(
                f"node {info.node_id!r} refused by cluster {self.config.cluster!r}: {field} is {mine} on the "
                f"node but {recorded} on the live nodes already registered{layouts}"
            )
        epoch = int(reply[1])
        await self.heartbeat(info, load, epoch)
        return epoch

    async def heartbeat(self, info: NodeInfo, load: NodeLoad, epoch: int) -> None:
        """Refresh the node's TTL and write its signed load; StaleEpoch if the node registered again since,
        NodeNotRegistered if the index lost it."""
        load_json = load.to_json()
        parts = _signed_parts(info.node_id.encode(), _stored(info), str(epoch).encode(), load_json)
        reply = await self._call(
            self._heartbeat, "heartbeat", info.node_id, load_json, self._hb_ms, self._records_ms, epoch,
            self._key.sign_record(parts),
        )  # fmt: skip
        self._check(reply, info.node_id, epoch)

    async def lost(self, node_ids: Sequence[NodeId]) -> list[bool]:
        """For each node, whether the index has no trace of it at all (not even its epoch counter, which
        deregistration and expiry keep): Redis lost its data (restarted empty, failed over), as opposed to
        the node having left."""
        if not node_ids:
            return []
        async with self._guard("lost"):
            counters = await self._redis.mget([f"{self._p}epoch:{n}" for n in node_ids])
        return [c is None for c in counters]

    async def deregister(self, node_id: NodeId) -> bool:
        """Remove a node and its records; returns whether it was registered."""
        return bool(await self._call(self._deregister, "deregister", node_id))

    async def nodes(self) -> list[NodeStatus]:
        """Live nodes (heartbeat not expired, current epoch, record signed), sorted by node id."""
        return (await self.listing()).live

    async def listing(self) -> NodeListing:
        """Live nodes whose records verify, and the live-looking records that do not (malformed, unsigned,
        signed with another key), each sorted by node id."""
        flat = await self._call(self._nodes, "nodes")
        now_ms = int(flat[0])
        live, invalid = [], []
        for i in range(1, len(flat), 7):
            row = flat[i : i + 7]
            status = self._verify(now_ms, row)
            if isinstance(status, NodeStatus):
                live.append(status)
            else:
                node_id, epoch = (v.decode(errors="replace") if v else "?" for v in (row[0], row[2]))
                invalid.append(InvalidRecord(node_id, epoch, status))
        return NodeListing(
            sorted(live, key=lambda s: s.info.node_id), sorted(invalid, key=lambda r: r.node_id)
        )

    def _verify(self, now_ms: int, row: Sequence[Any]) -> NodeStatus | str:
        """The NodeStatus of one NODES row, or why it cannot be trusted."""
        node_id, info_json, epoch, load_json, hb_ms, sig, records = row
        if not all(isinstance(v, bytes) and v for v in (node_id, info_json, epoch, load_json, hb_ms, sig)):
            return "missing fields (registered but never signed, or written by hand)"
        if not self._key.verify_record(
            _signed_parts(node_id, info_json, epoch, load_json), sig.decode(errors="replace")
        ):
            return "signature does not verify (not written by a holder of the cluster's credential)"
        try:
            info = dataclasses.replace(NodeInfo.from_json(info_json), epoch=int(epoch))
            load = NodeLoad.from_json(load_json)
        except (WireError, ValueError, TypeError) as exc:  # signed, yet unreadable: another record version
            return f"signed but unreadable: {str(exc)[:120]}"
        if info.node_id != node_id.decode():
            return f"registered under {node_id.decode()!r} but names itself {info.node_id!r}"
        return NodeStatus(
            info=info,
            load=load,
            heartbeat_age_s=max(0, now_ms - int(hb_ms)) / 1000.0 if hb_ms.isdigit() else 0.0,
            draining=load.draining,
            blocks_indexed=int(records),
        )

    # --- blocks ---------------------------------------------------------------------------------------------

    async def publish(self, node_id: NodeId, epoch: int, events: Sequence[BlockEvent]) -> int:
        """Apply a batch of Stored/Removed events in order, atomically, then the tier moves (BlockTiered;
        Removed hashes leave the host list too); returns the node's record count."""
        reply = await self._call(
            self._publish, "publish", node_id, epoch, self._records_ms, *_event_args(events)
        )
        count = self._check(reply, node_id, epoch)
        if any(isinstance(e, BlockTiered) for e in events):
            await self._tiers(node_id, epoch, events)
        return count

    async def _tiers(self, node_id: NodeId, epoch: int, events: Sequence[BlockEvent]) -> None:
        key = self._host_key(node_id, epoch)
        async with self._guard("publish tiers"):
            pipe = self._redis.pipeline(transaction=True)
            for event in events:
                hashes = list(event.block_hashes)
                if isinstance(event, BlockTiered) and event.tier == "host":
                    pipe.sadd(key, *hashes)
                elif not isinstance(event, BlockStored):
                    pipe.srem(key, *hashes)
            pipe.pexpire(key, self._records_ms)
            await pipe.execute()

    def _host_key(self, node_id: NodeId, epoch: int) -> str:
        return f"{self._p}blkhost:{node_id}:{epoch}"

    async def resync(
        self, node_id: NodeId, epoch: int, held: Sequence[BlockHash], host: Sequence[BlockHash] = ()
    ) -> int:
        """Replace all of a node's records with `held` (its digest, or a rebuild after Redis lost data), and
        its host-tier list with `host` (a subset of `held`)."""
        reply = await self._call(
            self._publish, "resync", node_id, epoch, self._records_ms, "C", 0, "S", len(held), *held
        )
        count = self._check(reply, node_id, epoch)
        key = self._host_key(node_id, epoch)
        async with self._guard("resync tiers"):
            pipe = self._redis.pipeline(transaction=True)
            pipe.delete(key)
            if host:
                pipe.sadd(key, *host)
                pipe.pexpire(key, self._records_ms)
            await pipe.execute()
        return count

    async def host_tier(self, node_id: NodeId, epoch: int, hashes: Sequence[BlockHash]) -> list[bool]:
        """For each hash, whether the node lists it in its host-memory tier."""
        if not hashes:
            return []
        async with self._guard("host tier"):
            found = await self._redis.smismember(self._host_key(node_id, epoch), list(hashes))
        return [bool(f) for f in found]

    async def lookup(self, hashes: Sequence[BlockHash]) -> dict[NodeId, int]:
        """Per live node holding block 0: the length of the longest run of `hashes` it holds from block 0.

        One round trip. An estimate for routing: a listed block may have been evicted since.
        """
        if not hashes:
            return {}
        blob = b"".join(hashes)
        if len(blob) != 32 * len(hashes):
            raise ValueError(
                f"lookup takes 32-byte block hashes; got {len(blob)} bytes for {len(hashes)} hashes"
            )
        flat = await self._call(self._lookup, "lookup", blob)
        return {NodeId(flat[i].decode()): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def blocks(self, node_id: NodeId | None = None, limit: int = 100) -> dict[NodeId, NodeBlocks]:
        """Record count and up to `limit` hashes per live node (or for one node; empty if it is not live)."""
        live = [s for s in await self.nodes() if node_id is None or s.info.node_id == node_id]
        out: dict[NodeId, NodeBlocks] = {}
        async with self._guard("blocks"):
            for status in live:
                key = f"{self._p}blk:{status.info.node_id}:{status.info.epoch}"
                hashes: list[BlockHash] = []
                if limit > 0:
                    async for member in self._redis.sscan_iter(key, count=max(limit, 100)):
                        hashes.append(BlockHash(member))
                        if len(hashes) >= limit:
                            break
                host = await self._redis.scard(self._host_key(status.info.node_id, status.info.epoch))
                out[status.info.node_id] = NodeBlocks(await self._redis.scard(key), tuple(hashes), host)
        return out

    async def evict_records(self, node_id: NodeId, hashes: Sequence[BlockHash] | None = None) -> int:
        """Drop index records of a node (the given hashes, or all); the node's own cache is untouched."""
        if hashes is not None and not hashes:
            return 0
        reply = await self._call(self._evict, "evict_records", node_id, *(hashes or ()))
        return self._check(reply, node_id)

    # --- the index against the truth (index/block_digest.py) ---------------------------------------------

    async def digest(self, node_id: NodeId, epoch: int) -> BlocksDigest:
        """The digest of the node's records (one round trip, O(1) in Redis)."""
        reply = await self._call(self._digest, "digest", node_id, epoch)
        self._check(reply, node_id, epoch)
        return BlocksDigest.from_reply(int(reply[1]), int(reply[2]), int(reply[3]))

    async def rebuild_digest(self, node_id: NodeId, epoch: int) -> int:
        """Recompute the digest from the records (O(records)); returns the record count."""
        return self._check(await self._call(self._rebuild, "rebuild_digest", node_id, epoch), node_id, epoch)

    async def records(self, node_id: NodeId, epoch: int) -> set[BlockHash]:
        """Every block hash recorded for the node's epoch (O(records))."""
        async with self._guard("records"):
            members = cast(set[bytes], await self._redis.smembers(f"{self._p}blk:{node_id}:{epoch}"))
        return {BlockHash(m) for m in members}

    async def recorded(self, node_id: NodeId, epoch: int, hashes: Sequence[BlockHash]) -> list[bool]:
        """For each hash, whether the node's epoch records it."""
        if not hashes:
            return []
        async with self._guard("recorded"):
            found = await self._redis.smismember(f"{self._p}blk:{node_id}:{epoch}", list(hashes))
        return [bool(f) for f in found]

    # --- prefix-hit statistics ------------------------------------------------------------------------------

    async def record_hits(
        self, node_id: NodeId, local_tokens: int, remote_tokens: int, miss_tokens: int
    ) -> None:
        """Add one request's prompt tokens: cached on the node, fetched from another node, computed."""
        key = f"{self._p}stats:{node_id}"
        async with self._guard("record_hits"):
            pipe = self._redis.pipeline(transaction=False)
            pipe.hincrby(key, "local", local_tokens)
            pipe.hincrby(key, "remote", remote_tokens)
            pipe.hincrby(key, "miss", miss_tokens)
            pipe.sadd(self._p + "stats_nodes", node_id)
            await pipe.execute()

    async def stats(self) -> dict[NodeId, HitStats]:
        """Accumulated hit statistics per node that ever recorded any."""
        async with self._guard("stats"):
            members: set[bytes] = cast(set[bytes], await self._redis.smembers(self._p + "stats_nodes"))
            ids = sorted(m.decode() for m in members)
            pipe = self._redis.pipeline(transaction=False)
            for node in ids:
                pipe.hgetall(f"{self._p}stats:{node}")
            rows = await pipe.execute()
        return {
            NodeId(node): HitStats(int(r.get(b"local", 0)), int(r.get(b"remote", 0)), int(r.get(b"miss", 0)))
            for node, r in zip(ids, rows, strict=True)
        }

    async def set_cost_rates(self, rates: bytes) -> None:
        """The router's learned placement rates (router/cost_model.py `Rates.to_json`), for `kvctl where`."""
        async with self._guard("set_cost_rates"):
            await self._redis.set(self._p + "costmodel", rates)

    async def cost_rates(self) -> str | None:
        async with self._guard("cost_rates"):
            raw = cast(bytes | None, await self._redis.get(self._p + "costmodel"))
        return None if raw is None else raw.decode()

    async def cluster_record(self) -> dict[str, str]:
        """The fingerprint, protocol version and KV layout the cluster's live nodes agree on ({} if none)."""
        async with self._guard("cluster_record"):
            raw = cast(dict[bytes, bytes], await self._redis.hgetall(self._p + "cluster"))
        return {k.decode(): v.decode() for k, v in raw.items()}
