"""Moving a node's running requests WITH their KV (`kvctl drain NODE --migrate`; a role change that migrates
calls the same `RequestMover.migrate_running`): each movable request's committed blocks (prompt and
generated tokens) are pinned, the index is given one publish pass to list them, and the request ends with
a migration signal (a StepOutput with `migrate` set), which the router continues on another node; that
node's prefilling node fetches the pinned blocks from here through the prefix-fetch path (node/kv_fetch.py)
instead of computing them.

Invariants: a pin ends exactly once: when this node exported the request's chain (`pulled`), or
`pull_window_s` seconds after the move (the router re-prefilled it elsewhere, or nobody came: logged);
while any pin is live the node counts it as held work (`pinned`), so a draining node keeps serving fetches
and deregisters only once its migrated requests' blocks were pulled or given up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from pdserve.node.node_metrics import NodeMetrics
from pdserve.shared.engine.async_engine import AsyncEngine
from pdserve.shared.types import BlockHash, BlockId, NodeId, RequestId

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Pin:
    hashes: tuple[BlockHash, ...]
    blocks: tuple[BlockId, ...]
    until: float
    """time.monotonic() past which the pin is given up."""


class RequestMover:
    """The node's moved requests and the pins on their blocks until another node pulls them."""

    def __init__(
        self,
        node_id: NodeId,
        aengine: AsyncEngine,
        metrics: NodeMetrics,
        published: Callable[[], Awaitable[None]],
        pull_window_s: float = 30.0,
    ) -> None:
        self.node_id = node_id
        self.aengine = aengine
        self.published = published
        self.pull_window_s = pull_window_s
        self._pins: dict[RequestId, _Pin] = {}
        self.moved = metrics.counter(
            "pdserve_node_drain_migrations",
            "Running requests this node ended so that another node continues them with their KV (drain or "
            "role change with --migrate)",
        )
        self.pulls = metrics.counter(
            "pdserve_node_drain_migration_pulls",
            "Moved requests' KV pins by how they ended: pulled (another node fetched the blocks), expired "
            "(nobody fetched them within the pull window: the continuation was prefilled) or finished (the "
            "request ended on its own before it was moved)",
            ["outcome"],
        )

    def pinned(self) -> int:
        """Moved requests whose blocks wait to be pulled (held work: the node does not deregister yet)."""
        return len(self._pins)

    async def migrate_running(self) -> int:
        """Ends every movable running request with the migration signal, its committed blocks pinned and
        published first; returns how many moved. Requests that cannot move (penalties, a grammar, no token
        yet) run on to their end here."""
        engine = self.aengine.engine

        def pin() -> list[tuple[RequestId, _Pin]]:
            until = time.monotonic() + self.pull_window_s
            return [(rid, _Pin(h, engine.hold_prefix(h), until)) for rid, h in engine.movable_requests()]

        pins = await self.aengine.call(pin)
        if not pins:
            return 0
        self._pins.update((rid, p) for rid, p in pins if p.blocks)
        await self.published()  # the index lists the pinned blocks before any router looks them up
        moved = 0
        for rid, p in pins:
            if await self.aengine.abort(rid, migrate=True):
                moved += 1
                log.info("request %s moves off node %s with its KV: %d blocks pinned until pulled", rid,
                         self.node_id, len(p.blocks))  # fmt: skip
            else:  # it ended on its own meanwhile: nobody will pull its blocks
                await self._release(rid, "finished")
        self.moved.inc(moved)
        return moved

    async def pulled(self, exported: Sequence[BlockHash]) -> None:
        """An export of this node sent the chain `exported`: the pins of the moved requests it covers end
        (same hash at the last position both chains have: a chained hash names its whole prefix)."""
        done = []
        for rid, p in self._pins.items():
            k = min(len(p.hashes), len(exported))
            if k and p.hashes[k - 1] == exported[k - 1]:
                done.append(rid)
        for rid in done:
            await self._release(rid, "pulled")
            log.info("moved request %s: its KV pin on node %s released after its pull", rid, self.node_id)

    async def expire_due(self) -> None:
        """Gives up the pins nobody pulled within the window (their continuations were prefilled)."""
        now = time.monotonic()
        for rid in [rid for rid, p in self._pins.items() if p.until <= now]:
            await self._release(rid, "expired")
            log.warning("moved request %s: nobody pulled its KV from node %s within %.0fs; released (its "
                        "continuation was prefilled elsewhere)", rid, self.node_id,
                        self.pull_window_s)  # fmt: skip

    async def _release(self, rid: RequestId, outcome: str) -> None:
        p = self._pins.pop(rid, None)
        if p is None:
            return
        engine = self.aengine.engine
        await self.aengine.call(lambda: engine.release_held(p.blocks))
        self.pulls.labels(outcome).inc()
