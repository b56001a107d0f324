"""A drain that keeps the cache, the nodes' side: the draining node says which cached prefixes are hottest
(`POST /internal/hot-prefixes`), and each node kvctl picks as the next holder of one pulls it from the
draining node through the prefix-fetch path (`POST /internal/pull-prefix`: node/kv_fetch.py's fetch, with its
handshake, deadline and release), keeps it CACHED, and publishes it to the index like any block it stores.

Invariants: a pull's reservation is released on every path (PrefixFetcher.release in `finally`), so the
pulled blocks end CACHED, never in use; a pull that would not fit in the pool's allocatable blocks, less one
per live request (the headroom D keeps for remote prompts), is refused before the holder is asked
(`no_room`); the receiving node counts what it got (prefixes and bytes moved in)
and the later prefix hits on those blocks (`pdserve_node_moved_prefix_hit_tokens`, from the engine's
snapshot). Metrics live on the receivers: the draining node leaves.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pdserve.node.kv_fetch import PrefixFetcher
from pdserve.node.node_routes import message_response
from pdserve.node.node_runtime import NodeRuntime
from pdserve.shared.node.move_protocol import (
    HotPrefix,
    HotPrefixes,
    HotPrefixesRequest,
    PullPrefix,
    PullResult,
)
from pdserve.shared.types import BlockHash, RequestId
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)


class _MovedHits(Collector):
    """Prefix hits on moved blocks, read from the latest engine snapshot at scrape time."""

    def __init__(self, rt: NodeRuntime) -> None:
        self.rt = rt

    def collect(self) -> Iterator[CounterMetricFamily]:
        tokens = self.rt.metrics.engine.moved_hit_blocks * self.rt.engine.cfg.block_size
        yield CounterMetricFamily(
            "pdserve_node_moved_prefix_hit_tokens",
            "Prompt tokens matched in this node's cache on blocks it got by a drain's move",
            value=tokens,
        )


class PrefixMoves:
    """Both ends of moving prefixes on one node (any role)."""

    def __init__(self, rt: NodeRuntime, fetcher: PrefixFetcher) -> None:
        self.rt = rt
        self.fetcher = fetcher
        m = rt.metrics
        self.moved_in = m.counter(
            "pdserve_node_moved_in_prefixes", "Prefix chains this node pulled from a draining node"
        )
        self.moved_in_bytes = m.counter(
            "pdserve_node_moved_in_bytes", "KV bytes of prefix blocks this node pulled from a draining node"
        )
        m.registry.register(_MovedHits(rt))

    async def hot(self, req: HotPrefixesRequest) -> HotPrefixes:
        engine = self.rt.engine
        budget = req.budget_bytes // engine.block_bytes
        chains = await self.rt.aengine.call(lambda: engine.hot_prefixes(budget))
        return HotPrefixes(
            self.rt.node_id,
            engine.cfg.block_size,
            engine.block_bytes,
            tuple(HotPrefix(tuple(c.hashes), c.hits, c.idle_s) for c in chains),
        )

    async def pull(self, req: PullPrefix) -> PullResult:
        engine, aengine = self.rt.engine, self.rt.aengine
        hashes = [BlockHash(h) for h in req.block_hashes]
        local, snap = await aengine.call(lambda: (engine.cached_prefix_blocks(hashes), engine.snapshot()))
        free = snap.kv_total_blocks - snap.kv_used_blocks  # FREE and cached-free blocks: allocatable
        kept = snap.running + snap.waiting  # a block each, so a move never starves the live requests
        need = len(hashes) - local
        if need <= 0:
            return PullResult(len(hashes), local, 0, 0)
        if need > free - kept:
            why = (f"no room: {free} allocatable KV blocks here ({kept} kept for live requests), the prefix "
                   f"needs {need}")  # fmt: skip
            return PullResult(len(hashes), local, 0, 0, error=why, no_room=True)
        rid = RequestId(f"move-{uuid.uuid4().hex[:12]}")
        fetched = await self.fetcher.fetch(rid, req.holder_url, hashes, local, req.deadline)
        try:
            landed = fetched.landed
            if landed:
                await aengine.call(lambda: engine.mark_moved(hashes[local : local + landed]))
                self.moved_in.inc()
                self.moved_in_bytes.inc(landed * engine.block_bytes)
        finally:
            await self.fetcher.release(fetched)
        error = None if local + landed >= len(hashes) else "the fetch brought fewer blocks (see the log)"
        log.info(
            "pulled prefix of %d blocks from draining node %s: %d were here, %d came", len(hashes),
            req.holder_node_id, local, landed,
        )  # fmt: skip
        return PullResult(len(hashes), local, landed, landed * engine.block_bytes, error=error)


def add_move_routes(app: FastAPI, moves: PrefixMoves) -> None:
    @app.post("/internal/hot-prefixes")
    async def hot(request: Request) -> Response:
        try:
            req = HotPrefixesRequest.from_json(await request.body())
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, 400)
        return message_response(await moves.hot(req))

    @app.post("/internal/pull-prefix")
    async def pull(request: Request) -> Response:
        try:
            req = PullPrefix.from_json(await request.body())
        except ValueError as exc:
            return message_response(PullResult(0, 0, 0, 0, error=str(exc)), 400)
        return message_response(await moves.pull(req))
