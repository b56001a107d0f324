"""The router's view of the cluster's nodes: what the Redis index lists with a valid signature and a proven
URL, kept while Redis is away, and found from a seed list of node URLs when the router starts during an
outage.

Invariants:
- The view is refreshed every `ttl_s` by one task (`run`); requests read it without waiting on Redis.
- Redis decides which nodes are listed, never what they are: a record enters the view only if its signature
  verifies with the cluster's credential (shared/index/block_index.py) and its `http_url` answered the
  router's challenge for its (node id, epoch) (once per epoch, before any work goes there). The rest are
  skipped, counted (`pdserve_router_invalid_node_records_total`) and logged once per node id and epoch; no
  record, however malformed, stops a refresh.
- While Redis answers, the view is the proven nodes it lists: a node whose entry expired or was deleted
  leaves at the next refresh, whatever its URL answers. The one exception is an index that lost its data
  (the node's epoch counter is gone too: Redis restarted empty or failed over): such a node stays while it
  answers a fresh challenge at every refresh (it holds the credential), until it registers again.
- While Redis cannot be reached, the last view is kept and each node stays only while it answers its own
  health (its breaker is opened when it does not); a seed URL's node joins once it answers the challenge.
- A node dropped from the view has its breaker forgotten, so no probe outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence

from pdserve.router.breaker import Breakers
from pdserve.router.metrics import RouterMetrics
from pdserve.router.node_client import NodeClients, NodeError
from pdserve.shared.index.block_index import BlockIndex
from pdserve.shared.index.block_index_types import IndexUnavailable, NodeStatus
from pdserve.shared.types import NodeId

log = logging.getLogger(__name__)
_MAX_REPORTED = 10_000


def _proof(status: NodeStatus) -> tuple[NodeId, int, str]:
    return status.info.node_id, status.info.epoch, status.info.http_url


class Membership:
    """Nodes a router may use; one per router process, shared by all requests."""

    def __init__(
        self,
        index: BlockIndex,
        clients: NodeClients,
        breakers: Breakers,
        metrics: RouterMetrics,
        ttl_s: float,
        seeds: Sequence[str] = (),
    ) -> None:
        self._index = index
        self._clients = clients
        self._breakers = breakers
        self._metrics = metrics
        self._ttl_s = ttl_s
        self._seeds = tuple(u.rstrip("/") for u in seeds)
        self._seed_ids: dict[str, NodeId] = {}
        self._view: dict[NodeId, NodeStatus] = {}
        self._proven: set[tuple[NodeId, int, str]] = set()
        """(node id, epoch, http url) whose URL answered the challenge."""
        self._reported: set[tuple[str, str]] = set()
        """(node id, epoch) of invalid records already counted and logged."""
        self._index_ok = True
        self._refreshed_at = float("-inf")
        self._lock = asyncio.Lock()

    @property
    def index_ok(self) -> bool:
        """Whether the last call to Redis succeeded."""
        return self._index_ok

    def index_failed(self) -> None:
        """A call to Redis on the request path failed: route load-only until the next refresh reaches it."""
        self._index_ok = False
        self._metrics.index_unavailable.inc()

    async def nodes(self) -> list[NodeStatus]:
        """The view, sorted by node id (built first if no refresh has run yet)."""
        if self._refreshed_at == float("-inf"):
            await self.refresh()
        return [self._view[n] for n in sorted(self._view)]

    async def run(self) -> None:
        """Refreshes the view every ttl_s until cancelled."""
        while True:
            with contextlib.suppress(Exception):  # a refresh never ends the loop; its failures are logged
                await self.refresh()
            await asyncio.sleep(self._ttl_s)

    async def refresh(self, max_age_s: float | None = None) -> None:
        """Reads the index again unless the view is younger than `max_age_s` (default: half the TTL)."""
        async with self._lock:
            if time.monotonic() - self._refreshed_at < (self._ttl_s / 2 if max_age_s is None else max_age_s):
                return  # another caller just did it
            try:
                await self._refresh()
            except Exception:
                log.exception("refreshing the node view failed")
                raise
            finally:
                self._refreshed_at = time.monotonic()

    async def _refresh(self) -> None:
        try:
            listing = await self._index.listing()
        except IndexUnavailable as exc:
            if self._index_ok:
                n = len(self._view)
                log.warning("Redis unreachable (%s): serving from the last view of %d nodes", exc, n)
            self.index_failed()
            await self._without_index()
            return
        if not self._index_ok:
            log.info("Redis answers again: it lists %d nodes", len(listing.live))
        self._index_ok = True
        for bad in listing.invalid:
            self._invalid(bad.node_id, bad.epoch, bad.reason)
        listed = {s.info.node_id: s for s in listing.live}
        await self._unlisted([s for n, s in self._view.items() if n not in listed])
        await self._prove(listing.live)
        for status in listing.live:
            node_id = status.info.node_id
            if _proof(status) not in self._proven:
                self._drop(node_id, "its URL has not answered the challenge for its epoch")
                continue
            self._view[node_id] = status
            if status.load is not None:
                stale = status.blocks_indexed - status.load.blocks_held
                self._metrics.index_stale_blocks.labels(node_id=node_id).set(stale)
        self._proven = {p for p in self._proven if p[0] in self._view}

    async def _unlisted(self, statuses: list[NodeStatus]) -> None:
        """Drops the nodes the index no longer lists, but for those of an index that lost its data which
        answer the challenge for their epoch again."""
        if not statuses:
            return
        try:
            lost = await self._index.lost([s.info.node_id for s in statuses])
        except IndexUnavailable:
            return  # Redis went away since the listing: decided at the next refresh
        kept = [s for s, gone in zip(statuses, lost, strict=True) if gone]
        proofs = await asyncio.gather(
            *(self._clients.get(s.info.node_id, s.info.http_url).prove(s.info.epoch) for s in kept)
        )
        still = {s.info.node_id for s, ok in zip(kept, proofs, strict=True) if ok}
        for status in statuses:
            if status.info.node_id not in still:
                self._drop(status.info.node_id, "it is no longer in the index")

    async def _without_index(self) -> None:
        await self._add_seeds()
        statuses = list(self._view.values())
        healths = await asyncio.gather(*(self._health(s) for s in statuses))
        for status, draining in zip(statuses, healths, strict=True):
            if draining is None:
                self._breakers.trip(status.info.node_id, status.info.http_url, "health while Redis is away")
            elif status.draining != draining:
                self._view[status.info.node_id] = dataclasses.replace(status, draining=draining)

    async def _prove(self, statuses: Sequence[NodeStatus]) -> None:
        """Challenges each node's URL not yet proven for its epoch (concurrently)."""
        todo = [s for s in statuses if _proof(s) not in self._proven]
        answers = await asyncio.gather(
            *(self._clients.get(s.info.node_id, s.info.http_url).prove(s.info.epoch) for s in todo)
        )
        for status, ok in zip(todo, answers, strict=True):
            if ok:
                self._proven.add(_proof(status))
            else:
                why = f"{status.info.http_url} did not answer the challenge as this node (no credential?)"
                self._invalid(status.info.node_id, str(status.info.epoch), why)

    def _invalid(self, node_id: str, epoch: str, reason: str) -> None:
        if (node_id, epoch) in self._reported:
            return
        if len(self._reported) >= _MAX_REPORTED:  # a flood of bad records: log anew rather than grow
            self._reported.clear()
        self._reported.add((node_id, epoch))
        self._metrics.invalid_node_records.inc()
        log.warning("ignoring node record %r epoch %s in the index: %s", node_id[:64], epoch[:20], reason)

    async def _health(self, status: NodeStatus) -> bool | None:
        return await self._clients.get(status.info.node_id, status.info.http_url).health()

    def _drop(self, node_id: NodeId, why: str) -> None:
        if self._view.pop(node_id, None) is not None:
            log.info("node %s leaves the router's view: %s", node_id, why)
        self._breakers.forget(node_id)
        with contextlib.suppress(KeyError):
            self._metrics.index_stale_blocks.remove(node_id)

    async def _add_seeds(self) -> None:
        missing = [u for u in self._seeds if self._seed_ids.get(u) not in self._view]
        found = await asyncio.gather(*(self._registration(u) for u in missing))
        await self._prove([s for s in found if s is not None])
        for url, status in zip(missing, found, strict=True):
            if status is None or _proof(status) not in self._proven:
                continue
            node_id = status.info.node_id
            self._seed_ids[url] = node_id
            if node_id not in self._view:
                log.info("node %s found at seed %s (epoch %d)", node_id, url, status.info.epoch)
                self._view[node_id] = status

    async def _registration(self, url: str) -> NodeStatus | None:
        try:
            info = await self._clients.registration(url)
        except NodeError as exc:
            log.debug("seed %s: %s", url, exc)
            return None
        return NodeStatus(info=info, load=None, heartbeat_age_s=0.0, draining=False, blocks_indexed=0)
