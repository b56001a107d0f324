"""The index tells the truth about this node: at every heartbeat the node folds the block hashes it holds into
a digest (block_index_types.BlocksDigest) and compares it with the one the index keeps of its records; a
disagreement that lasts is found by a full comparison and repaired.

Invariants:
- The per-heartbeat check costs one O(1) round trip to Redis; a full comparison (O(records)) runs only after
  `MISMATCHES_TO_COMPARE` mismatched checks in a row (a check may race a batch of block events still on its
  way, so one mismatch proves nothing), or when asked (`kvctl diff`).
- A record is called extra (indexed, not held) or missing (held, not indexed) only if it still disagrees
  `SETTLE_S` after it was first seen (longer than a publish takes), so events in flight are never "repaired".
- Repairs go through `BlockIndex.publish` (Removed for extra, Stored for missing), so they keep the index's
  own digest right; a digest that stays wrong over right records is rebuilt from the records.
- Nothing here raises a Redis failure into the heartbeat: the next heartbeat tries again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pdserve.shared.engine.block_pool import BlockEvent, BlockRemoved, BlockStored
from pdserve.shared.index.block_index import BlockIndex
from pdserve.shared.index.block_index_types import BlockIndexError, BlocksDigest
from pdserve.shared.types import BlockHash, NodeId
from prometheus_client import CollectorRegistry, Counter, Gauge

log = logging.getLogger(__name__)

MISMATCHES_TO_COMPARE = 3
SETTLE_S = 0.25
_LISTED = 20
"""Hashes of each kind a diff lists (the counts are always whole)."""


@dataclass(frozen=True)
class IndexDiff:
    """This node's records in the index against the blocks it holds (after settling; see the module)."""

    node_id: NodeId
    epoch: int
    held: int
    indexed: int
    extra: tuple[BlockHash, ...]
    """Recorded in the index, not held: routing would count on blocks that are gone."""
    missing: tuple[BlockHash, ...]
    """Held, not recorded: prefix hits the router cannot see."""
    repaired: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "epoch": self.epoch,
            "held": self.held,
            "indexed": self.indexed,
            "extra": len(self.extra),
            "missing": len(self.missing),
            "extra_hashes": [h.hex() for h in self.extra[:_LISTED]],
            "missing_hashes": [h.hex() for h in self.missing[:_LISTED]],
            "repaired": self.repaired,
        }


class IndexTruth:
    """One per node. `check(epoch)` after each heartbeat; `diff(epoch, repair)` for kvctl diff."""

    def __init__(
        self,
        index: BlockIndex,
        node_id: NodeId,
        held: Callable[[], Awaitable[list[BlockHash]]],
        registry: CollectorRegistry,
    ) -> None:
        self._index = index
        self._node_id = node_id
        self._held = held
        self._mismatches = 0
        self._lock = asyncio.Lock()
        self._checks = Counter(
            "pdserve_node_index_digest_checks",
            "Heartbeat comparisons of the held blocks' digest with the index's, by result.",
            ["result"],
            registry=registry,
        )
        self._stale = Gauge(
            "pdserve_node_index_stale_blocks",
            "Index records of this node that disagreed with its blocks at the last full comparison: extra "
            "(indexed, not held) or missing (held, not indexed).",
            ["kind"],
            registry=registry,
        )
        self._repaired = Counter(
            "pdserve_node_index_repaired_blocks",
            "Index records of this node repaired: extra ones removed, missing ones added.",
            ["kind"],
            registry=registry,
        )
        for kind in ("extra", "missing"):
            self._stale.labels(kind=kind)
            self._repaired.labels(kind=kind)

    async def check(self, epoch: int) -> None:
        """The per-heartbeat check; compares and repairs in full after MISMATCHES_TO_COMPARE mismatches."""
        try:
            mine = BlocksDigest.of(await self._held())
            theirs = await self._index.digest(self._node_id, epoch)
            if mine == theirs:
                self._checks.labels(result="match").inc()
                self._mismatches = 0
                self._stale.labels(kind="extra").set(0)
                self._stale.labels(kind="missing").set(0)
                return
            self._checks.labels(result="mismatch").inc()
            self._mismatches += 1
            if self._mismatches >= MISMATCHES_TO_COMPARE:
                self._mismatches = 0
                await self.diff(epoch, repair=True)
        except BlockIndexError as exc:
            log.warning("index digest check failed: %s", exc)

    async def diff(self, epoch: int, repair: bool) -> IndexDiff:
        """Compare the node's records with its blocks in full; with repair, fix what disagrees.
        BlockIndexError propagates (kvctl reports it)."""
        async with self._lock:
            return await self._diff(epoch, repair)

    async def _diff(self, epoch: int, repair: bool) -> IndexDiff:
        index, node = self._index, self._node_id
        held_now = set(await self._held())
        indexed = await index.records(node, epoch)
        extra, missing = indexed - held_now, held_now - indexed
        if extra or missing:
            await asyncio.sleep(SETTLE_S)  # let events in flight land, then keep what still disagrees
            held_now = set(await self._held())
            suspects = [*extra, *missing]
            recorded = dict(zip(suspects, await index.recorded(node, epoch, suspects), strict=True))
            extra = {h for h in extra if recorded[h] and h not in held_now}
            missing = {h for h in missing if not recorded[h] and h in held_now}
        self._stale.labels(kind="extra").set(len(extra))
        self._stale.labels(kind="missing").set(len(missing))
        if repair:
            await self._repair(epoch, extra, missing, held_now)
        return IndexDiff(
            node, epoch, len(held_now), len(indexed), tuple(sorted(extra)), tuple(sorted(missing)), repair
        )

    async def _repair(
        self, epoch: int, extra: set[BlockHash], missing: set[BlockHash], held: set[BlockHash]
    ) -> None:
        index, node = self._index, self._node_id
        if extra or missing:
            events: list[BlockEvent] = []
            if extra:
                events.append(BlockRemoved(tuple(extra)))
            if missing:
                events.append(BlockStored(tuple(missing), None))
            await index.publish(node, epoch, events)
            self._repaired.labels(kind="extra").inc(len(extra))
            self._repaired.labels(kind="missing").inc(len(missing))
            log.warning(
                "index repaired: %d stale records removed, %d missing added", len(extra), len(missing)
            )
        elif await index.digest(node, epoch) != BlocksDigest.of(list(held)):
            await index.rebuild_digest(node, epoch)  # right records under a wrong digest: recompute it
