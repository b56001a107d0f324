"""The fleet's admission leases in Redis: what every router of a cluster has in flight on each node, so that a
per-node cap holds for the fleet (router/ledger_redis.py reads and writes it; schema in docs/redis_index.md).

Keys (beside the block index's, under the cluster's hash tag `P = pdserve:{<cluster>}:`):
- `P lease:<node>`: sorted set, member = lease id (`<host>.<pid>.<random>:<placement>:<choice>`: the
  router that holds it first), score = its expiry (Redis clock, ms).
  One member per request a router placed on the node and has not seen end.
- `P ptok:<node>`: sorted set, member = `<lease id>|<tokens>`, score = its expiry: prompt tokens a lease's
  request is predicted to compute on the node, until its prefill ends; `P ptoksum`: hash, node -> the sum
  of its `ptok` members' tokens, kept by every script that adds or drops one (so a count is O(expired), not
  O(leases)).
- `P admq`: sorted set, member = a waiting placement's ticket, score = when it began to wait (Redis clock,
  ms); `P admq_exp`: the same tickets, score = expiry (refreshed with the leases). A placement may book
  only if fewer tickets are older than its own (all of them, when it has none) than its node has free
  places: the fleet admits in arrival order. A read of the counts (`look`) also answers the queue's head,
  the live tickets that may book now, so each router wakes only its waiters whose turn it is.
Invariants: booking is one script that first drops expired members and then adds the leases only if the
node holds fewer than the cap (so two routers can never both pass a cap with one free place); a lease
lives until released or until `ttl` after its router's last refresh, so a router that dies leaks nothing
for longer than `ttl`; a refresh only extends members that still exist (ZADD XX), never revives a released
one; every key's own TTL is reset to `ttl` on each write, so a node nobody books on leaves no key behind.
Redis failures raise the index's `IndexUnavailable`, as block_index.py's calls do; at most
`max_connections` calls run at once (the others wait for a connection instead of failing).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import redis.exceptions as rexc
from pdserve.shared.index.block_index import connect
from pdserve.shared.index.block_index_types import IndexUnavailable, RedisConfig
from pdserve.shared.types import NodeId

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

_COUNT = """
local function count(p, node, now)
  local lk, tk, sums = p .. 'lease:' .. node, p .. 'ptok:' .. node, p .. 'ptoksum'
  redis.call('ZREMRANGEBYSCORE', lk, '-inf', now)
  local gone = 0
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', tk, '-inf', now)) do
    gone = gone + tonumber(string.match(m, '|(%d+)$'))
  end
  if gone > 0 then
    redis.call('ZREMRANGEBYSCORE', tk, '-inf', now)
    redis.call('HINCRBY', sums, node, -gone)
  end
  if redis.call('ZCARD', tk) == 0 then redis.call('HDEL', sums, node) end
  return redis.call('ZCARD', lk), tonumber(redis.call('HGET', sums, node) or '0')
end
"""

_PRUNE = """
local function prune(p, now)
  local q, qx = p .. 'admq', p .. 'admq_exp'
  for _, dead in ipairs(redis.call('ZRANGEBYSCORE', qx, '-inf', now)) do
    redis.call('ZREM', q, dead)
    redis.call('ZREM', qx, dead)
  end
end
"""

_AHEAD = """
local function ahead(p, ticket, now, ttl)
  local q, qx = p .. 'admq', p .. 'admq_exp'
  prune(p, now)
  if ticket == '' then return redis.call('ZCARD', q) end
  local mine = redis.call('ZSCORE', q, ticket)
  if not mine then  -- its ticket is gone (it expired while its router stalled): it waits again from now
    mine = tostring(now)
    redis.call('ZADD', q, now, ticket)
    redis.call('ZADD', qx, now + ttl, ticket)
    redis.call('PEXPIRE', q, ttl)
    redis.call('PEXPIRE', qx, ttl)
  end
  return redis.call('ZCOUNT', q, '-inf', '(' .. mine)
end
"""

BOOK = (
    _NOW
    + _COUNT
    + _PRUNE
    + _AHEAD
    + """
-- ARGV: prefix, ttl_ms, cap, n, lease base id, tokens, decode node, prefill node ('' when D prefills),
-- the placement's ticket in the queue ('' when it never waited)
local p, ttl, cap, n = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local base, tokens, decode, prefill, ticket = ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9]
local nodes = {decode}
if prefill ~= '' then nodes[2] = prefill end
local before = 0
if cap > 0 then before = ahead(p, ticket, now, ttl) end
local out = {}
for _, node in ipairs(nodes) do
  local held, tok = count(p, node, now)
  if cap > 0 and (held >= cap or before >= cap - held) then return {'FULL', node, held, tok} end
  out[#out + 1] = node
  out[#out + 1] = held + n
  out[#out + 1] = tok
end
local expiry = now + ttl
local prefilling = nodes[#nodes]
for i = 1, n do
  local id = base .. ':' .. i
  for _, node in ipairs(nodes) do redis.call('ZADD', p .. 'lease:' .. node, expiry, id) end
  redis.call('ZADD', p .. 'ptok:' .. prefilling, expiry, id .. '|' .. tokens)
end
redis.call('HINCRBY', p .. 'ptoksum', prefilling, n * tonumber(tokens))
redis.call('PEXPIRE', p .. 'ptoksum', ttl)
out[#out] = out[#out] + n * tonumber(tokens)
for _, node in ipairs(nodes) do
  redis.call('PEXPIRE', p .. 'lease:' .. node, ttl)
  redis.call('PEXPIRE', p .. 'ptok:' .. node, ttl)
end
if ticket ~= '' then
  redis.call('ZREM', p .. 'admq', ticket)
  redis.call('ZREM', p .. 'admq_exp', ticket)
end
table.insert(out, 1, 'OK')
return out
"""
)

ENQUEUE = (
    _NOW
    + """
-- ARGV: prefix, ttl_ms, ticket: the placement waits from now (Redis's clock) in the fleet's queue
local p, ttl, ticket = ARGV[1], tonumber(ARGV[2]), ARGV[3]
redis.call('ZADD', p .. 'admq', 'NX', now, ticket)
redis.call('ZADD', p .. 'admq_exp', now + ttl, ticket)
redis.call('PEXPIRE', p .. 'admq', ttl)
redis.call('PEXPIRE', p .. 'admq_exp', ttl)
return 0
"""
)

REFRESH = (
    _NOW
    + """
-- ARGV: prefix, ttl_ms, then pairs (key suffix, member): extends the members that still exist
local p, ttl = ARGV[1], tonumber(ARGV[2])
local expiry = now + ttl
local touched = {}
for i = 3, #ARGV, 2 do
  local key = p .. ARGV[i]
  if redis.call('ZSCORE', key, ARGV[i + 1]) then redis.call('ZADD', key, 'XX', expiry, ARGV[i + 1]) end
  touched[key] = true
end
for key in pairs(touched) do redis.call('PEXPIRE', key, ttl) end
if touched[p .. 'admq_exp'] then redis.call('PEXPIRE', p .. 'admq', ttl) end
redis.call('PEXPIRE', p .. 'ptoksum', ttl)
return 0
"""
)

RELEASE = """
-- ARGV: prefix, then pairs (key suffix, member): removes them; a removed token entry leaves the node's sum
local p = ARGV[1]
for i = 2, #ARGV, 2 do
  local removed = redis.call('ZREM', p .. ARGV[i], ARGV[i + 1])
  local node = string.match(ARGV[i], '^ptok:(.+)$')
  local tokens = node and tonumber(string.match(ARGV[i + 1], '|(%d+)$')) or 0
  if removed == 1 and tokens > 0 then redis.call('HINCRBY', p .. 'ptoksum', node, -tokens) end
end
return 0
"""

COUNTS = (
    _NOW
    + _COUNT
    + _PRUNE
    + """
-- ARGV: prefix, cap, node ids; answers requests, tokens per node, then the queue's head: the live tickets
-- that may book somewhere (fewer older ones than the freest of these nodes has free places), oldest first
local p, cap = ARGV[1], tonumber(ARGV[2])
local out, free = {}, 0
for i = 3, #ARGV do
  local held, tok = count(p, ARGV[i], now)
  out[#out + 1] = held
  out[#out + 1] = tok
  if cap - held > free then free = cap - held end
end
local head = {}
if cap > 0 and free > 0 then
  prune(p, now)
  head = redis.call('ZRANGE', p .. 'admq', 0, free - 1)
end
out[#out + 1] = head
return out
"""
)


@dataclass(frozen=True)
class NodeLeases:
    """What the fleet has in flight on one node: requests (leases) and prompt tokens still to prefill."""

    requests: int = 0
    prefill_tokens: int = 0


@dataclass(frozen=True)
class Booked:
    """A booking's answer: the leases were taken (`full` None) with the nodes' counts after it, or the node
    that was at the cap (`full`) with its counts."""

    full: NodeId | None
    counts: dict[NodeId, NodeLeases]


@dataclass(frozen=True)
class Look:
    """A read of the fleet's ledger: counts per node, and the tickets at the head of the queue (those
    with fewer older tickets than some node has free places: only they may book now)."""

    counts: dict[NodeId, NodeLeases]
    head: frozenset[str]


def lease_member(node: NodeId) -> str:
    """The key suffix (after the prefix) of a node's leases."""
    return f"lease:{node}"


def tokens_member(node: NodeId) -> str:
    return f"ptok:{node}"


def ticket_entries(ticket: str) -> tuple[tuple[str, str], tuple[str, str]]:
    """A queued placement's two entries (key suffix, member): its arrival, then its expiry (the one a
    refresh extends)."""
    return ("admq", ticket), ("admq_exp", ticket)


class LeaseTable:
    """The Redis side of the fleet's leases; one per router process. Its own connection pool, so a slow
    index call never holds up a lease (and the reverse)."""

    def __init__(self, config: RedisConfig) -> None:
        self._config = config
        self._redis = connect(config)
        self._p = config.prefix
        self._key = [config.prefix + "nodes"]  # declared so a script runs where the cluster's keys live
        reg = self._redis.register_script
        self._book, self._refresh, self._counts = reg(BOOK), reg(REFRESH), reg(COUNTS)
        self._enqueue, self._release = reg(ENQUEUE), reg(RELEASE)
        # redis-py's pool fails a call at once when every connection is busy: calls queue here instead
        self._slots = asyncio.Semaphore(config.max_connections)

    async def close(self) -> None:
        await self._redis.aclose()

    @asynccontextmanager
    async def _guard(self, what: str) -> AsyncIterator[None]:
        async with self._slots:
            try:
                yield
            except (rexc.RedisError, OSError) as exc:
                raise IndexUnavailable(f"Redis at {self._config.address}: {what} failed: {exc}") from exc

    async def book(
        self,
        ttl_ms: int,
        cap: int,
        n: int,
        lease_base: str,
        tokens: int,
        decode: NodeId,
        prefill: NodeId | None,
        ticket: str | None,
    ) -> Booked:
        """n leases on `decode` (and `prefill`), `tokens` each on the prefilling node, ids `<base>:1..n`;
        none when a node holds `cap` leases already (cap 0: no cap and no queue), or when at least as many
        placements queued before `ticket` (before now, without one) as the node has free places. A booking
        takes its ticket out of the queue."""
        args: list[Any] = [self._p, ttl_ms, cap, n, lease_base, tokens, decode, prefill or "", ticket or ""]
        async with self._guard("booking a lease"):
            reply = await self._book(keys=self._key, args=args)
        if reply[0] == b"FULL":
            full = NodeId(reply[1].decode())
            return Booked(full, {full: NodeLeases(reply[2], reply[3])})
        rows = reply[1:]
        counts = {
            NodeId(rows[i].decode()): NodeLeases(rows[i + 1], rows[i + 2]) for i in range(0, len(rows), 3)
        }
        return Booked(None, counts)

    async def enqueue(self, ttl_ms: int, ticket: str) -> None:
        """The placement `ticket` waits from now in the fleet's queue (again: keeps its first arrival)."""
        async with self._guard("queueing"):
            await self._enqueue(keys=self._key, args=[self._p, ttl_ms, ticket])

    async def refresh(self, ttl_ms: int, members: Sequence[tuple[str, str]]) -> None:
        """Extends every (key suffix, member) that still exists to `ttl_ms` from now: one call for all."""
        if not members:
            return
        async with self._guard("refreshing leases"):
            flat = [x for pair in members for x in pair]
            await self._refresh(keys=self._key, args=[self._p, ttl_ms, *flat])

    async def release(self, members: Sequence[tuple[str, str]]) -> None:
        """Removes the (key suffix, member) pairs (a lease ended)."""
        if not members:
            return
        async with self._guard("releasing leases"):
            flat = [x for pair in members for x in pair]
            await self._release(keys=self._key, args=[self._p, *flat])

    async def counts(self, nodes: Sequence[NodeId]) -> dict[NodeId, NodeLeases]:
        """The fleet's live leases per node (expired ones dropped first)."""
        return (await self.look(nodes, 0)).counts

    async def look(self, nodes: Sequence[NodeId], cap: int) -> Look:
        """The fleet's live leases per node and, under `cap` (> 0), the queue's head: the waiting tickets
        whose turn it may be on one of `nodes` (expired leases and tickets dropped first)."""
        if not nodes:
            return Look({}, frozenset())
        async with self._guard("reading leases"):
            flat = await self._counts(keys=self._key, args=[self._p, cap, *nodes])
        counts = {node: NodeLeases(flat[2 * i], flat[2 * i + 1]) for i, node in enumerate(nodes)}
        return Look(counts, frozenset(t.decode() for t in flat[-1]))
