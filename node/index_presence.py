"""The node's presence in the Redis block index: its registration and epoch, the signed heartbeat, and the
block records it publishes; the trouble log when the index does not answer.

Invariants: the node registers at start (a new epoch), publishes its pool's Stored/Removed events in order
and in batches, and after Redis comes back re-sends its whole held set (resync), so the index converges to
the truth. A node the index no longer knows (Redis restarted empty, or lost the node's keys) registers again
with a new epoch, as draining if it is, and then resyncs; only `publish` writes block records, and every
(re-)registration goes through the one lock, so the heartbeat and the publish loop never both register.
Index trouble is logged once when it starts, at most once a minute while it lasts, and once when the index
answers again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable

from pdserve.shared.engine.block_pool import BlockEvent
from pdserve.shared.index.block_digest import IndexTruth
from pdserve.shared.index.block_index import BlockIndex
from pdserve.shared.index.block_index_types import (
    BlockIndexError,
    NodeInfo,
    NodeLoad,
    NodeNotRegistered,
    StaleEpoch,
)
from pdserve.shared.types import BlockHash, NodeId, Role

log = logging.getLogger(__name__)

Holdings = tuple[list[BlockHash], list[BlockHash]]
"""The blocks the node holds: (on the device, in the host tier)."""


class IndexLink:
    """Whether the index answered this node's last call, and the log lines that say so: a warning when
    trouble starts, at most one more every `repeat_s` while it lasts, one line when the index answers."""

    def __init__(self, address: str, repeat_s: float = 60.0) -> None:
        self.address = address
        self.repeat_s = repeat_s
        self.down_since: float | None = None
        self._logged_at = 0.0

    def failed(self, what: str, exc: BlockIndexError) -> None:
        now = time.monotonic()
        if self.down_since is None:
            self.down_since = self._logged_at = now
            log.warning(
                "index at %s: %s failed (%s); serving on, and resyncing once it answers (next warning in "
                "%.0fs if it does not)", self.address, what, exc, self.repeat_s,
            )  # fmt: skip
        elif now - self._logged_at >= self.repeat_s:
            self._logged_at = now
            log.warning(
                "index at %s: still failing after %.0fs: %s", self.address, now - self.down_since, exc
            )

    def answered(self) -> None:
        if self.down_since is not None:
            log.info(
                "index reachable again at %s after %.1fs", self.address, time.monotonic() - self.down_since
            )
            self.down_since = None


class IndexPresence:
    """One node's registration in the index. `load` reads the node's load (its drain flag included) and
    `holdings` the blocks it holds; both run on the engine's thread, so their counts are consistent."""

    def __init__(
        self,
        index: BlockIndex,
        node_id: NodeId,
        truth: IndexTruth,
        load: Callable[[], Awaitable[NodeLoad]],
        holdings: Callable[[], Awaitable[Holdings]],
    ) -> None:
        self.index = index
        self.node_id = node_id
        self.truth = truth
        self._load = load
        self._holdings = holdings
        self.epoch = 0
        self.info: NodeInfo | None = None
        """The registration (None before the node registered); its epoch field is the first one's."""
        self.deregistered = False
        self.need_resync = False
        self._lock = asyncio.Lock()
        self._link = IndexLink(index.config.address)

    async def register(self, info: NodeInfo) -> None:
        """Registers under `info` with a new epoch and has the next publish resend every held block;
        BlockIndexError (and IncompatibleNode at start) propagates and leaves the old registration."""
        async with self._lock:
            load = await self._load()
            after = self.epoch if self.info is not None else None
            self.epoch = (
                await self.index.register(info, load)
                if after is None
                else await self.index.register(info, load, after_epoch=after)
            )
            self.info, self.deregistered, self.need_resync = info, False, after is not None

    async def deregister(self, *, quiet: bool) -> None:
        """Leaves the index, so routers stop choosing this node at once. `quiet`: at shutdown, where the
        index's trouble is no longer worth a line; otherwise it is logged and the node stays registered."""
        try:
            await self.index.deregister(self.node_id)
            self.deregistered = True
            self._link.answered()
        except BlockIndexError as exc:
            if quiet:
                self.deregistered = True
            else:
                self._link.failed("deregister", exc)

    async def beat(self, load: NodeLoad) -> None:
        """One signed heartbeat carrying `load`; registers again when the index lost the node."""
        assert self.info is not None
        epoch, what = self.epoch, "heartbeat"
        try:
            try:
                await self.index.heartbeat(self.info, load, epoch)
                if not self.need_resync:
                    await self.truth.check(epoch)  # shared/index/block_digest.py; logs its own failures
            except NodeNotRegistered:
                what = "registering again"
                await self._register_again(epoch)  # its first heartbeat carries the load, for the router
            except StaleEpoch as exc:
                if exc.current >= epoch:  # a newer registration of this node id: not this process's to undo
                    raise
                what = "registering again"  # the index lost the last registration (a failover)
                await self._register_again(epoch)
            self._link.answered()
        except StaleEpoch as exc:
            if epoch == self.epoch:  # not the other loop's re-registration racing this beat
                self._link.failed(what, exc)
        except BlockIndexError as exc:
            self._link.failed(what, exc)
            self.need_resync = True

    async def publish(self, events: list[BlockEvent]) -> None:
        """Writes `events` to the node's block records, or, when a resync is due, lists every held block
        instead (the events drained before the listing are covered by it)."""
        epoch, what = self.epoch, "publish"
        try:
            try:
                if self.need_resync:
                    what = "resync"
                    held, host = await self._holdings()
                    await self.index.resync(self.node_id, epoch, held, host)
                    self.need_resync = False
                    log.info("node %s: index resynced, %d blocks at epoch %d", self.node_id, len(held), epoch)
                else:
                    await self.index.publish(self.node_id, epoch, events)
            except NodeNotRegistered:
                what = "registering again"
                self.need_resync = True
                await self._register_again(epoch)
            except StaleEpoch as exc:
                if exc.current >= epoch:
                    raise
                what = "registering again"  # the index lost the last registration (a failover)
                self.need_resync = True
                await self._register_again(epoch)
            self._link.answered()
        except StaleEpoch as exc:
            self.need_resync = True  # at the current epoch, next tick
            if epoch == self.epoch:  # not the heartbeat's re-registration racing this publish
                self._link.failed(what, exc)
        except BlockIndexError as exc:
            self._link.failed(what, exc)
            self.need_resync = True

    async def _register_again(self, seen_epoch: int) -> None:
        """The index lost this node (Redis restarted empty, or a failover lost its last registration):
        register with a new epoch, draining if the node is, and have the next publish resync every block it
        holds. A no-op if the other loop already did it since `seen_epoch`."""
        assert self.info is not None
        async with self._lock:
            if self.epoch != seen_epoch or self.deregistered:
                return
            load = await self._load()  # its drain flag: the node's own, signed
            self.epoch = await self.index.register(self.info, load, after_epoch=seen_epoch)
            self.need_resync = True
        log.warning(
            "node %s was not registered in the index (Redis lost its data?): registered again, epoch %d -> "
            "%d%s; resyncing every block it holds", self.node_id, seen_epoch, self.epoch,
            ", draining" if load.draining else "",
        )  # fmt: skip

    def registered_as(self, role: Role, transfer_addr: str) -> NodeInfo:
        """The node's registration under another role and transfer address (to `register`)."""
        assert self.info is not None
        return dataclasses.replace(self.info, role=role, transfer_addr=transfer_addr)
