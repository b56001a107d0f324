"""The router's view of the cluster's nodes: what the Redis index lists, kept while Redis is away or comes
back empty, and found from a seed list of node URLs when the router starts during an outage.

Invariants:
- The view is refreshed every `ttl_s` by one task (`run`); requests read it without waiting on Redis.
- A node the index lists is in the view as the index says (epoch, load, draining).
- A node in the view that the index no longer lists (Redis restarted empty or failed over, the node's
  registration lost), every node while Redis cannot be reached, and a node found through a seed URL, stay in
  the view only while they answer their own health (as themselves, not draining); one that does not is
  dropped when Redis is up (it is gone by both accounts) and its breaker opened when Redis is down.
- A node dropped from the view has its breaker forgotten, so no probe outlives it.
- Seed URLs are asked for their node's registration (`GET /internal/registration`, the cluster's credential)
  only while no node of that id is in the view.
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
        self._listed: set[NodeId] = set()
        """Nodes the index listed at the last refresh that reached Redis."""
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

    def unlisted(self) -> list[NodeId]:
        """Nodes in the view that the index does not list now (kept on their own health)."""
        return sorted(set(self._view) - self._listed)

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

    async def refresh(self) -> None:
        async with self._lock:
            if time.monotonic() - self._refreshed_at < self._ttl_s / 2:
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
            listed = await self._index.nodes()
        except IndexUnavailable as exc:
            if self._index_ok:
                n = len(self._view)
                log.warning("Redis unreachable (%s): serving from the last view of %d nodes", exc, n)
            self.index_failed()
            listed = None
        if listed is not None:
            if not self._index_ok:
                log.info("Redis answers again: it lists %d nodes", len(listed))
            self._index_ok = True
            self._listed = {s.info.node_id for s in listed}
            for status in listed:
                self._view[status.info.node_id] = status
                if status.load is not None:
                    stale = status.blocks_indexed - status.load.blocks_held
                    self._metrics.index_stale_blocks.labels(node_id=status.info.node_id).set(stale)
        await self._add_seeds()
        unconfirmed = [s for n, s in self._view.items() if n not in self._listed or listed is None]
        healths = await asyncio.gather(*(self._health(s) for s in unconfirmed))
        for status, draining in zip(unconfirmed, healths, strict=True):
            node_id = status.info.node_id
            if draining is None and listed is not None:
                self._drop(node_id, "it is not in the index and does not answer its health")
            elif draining is None:
                self._breakers.trip(node_id, status.info.http_url, "health while Redis is away")
            elif draining and node_id not in self._listed:
                self._drop(node_id, "it left the index draining")
            elif status.draining != draining:
                self._view[node_id] = dataclasses.replace(status, draining=draining)

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
        for url, status in zip(missing, found, strict=True):
            if status is None:
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
