"""A node's reservations for KV that another node sends into its pool: the decode node's OPEN and a prefix
fetch's OPEN reserve, hand over and give back blocks through this one handle.

Invariants: a `KVReservation` ends exactly once: given back by `release` (idempotent), or handed over by
`take` (the engine's `admit_remote` took the blocks); a new or ended handle holds nothing and releasing it
releases nothing (SGLang's receipt: a lost or repeated release under-releases, never frees another request's
blocks). A reservation whose caller was cancelled while the engine thread made it is given back as soon as
the engine returns it, so a cancelled OPEN never leaves blocks reserved; a release is shielded from the
cancellation of the task that asked for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from pdserve.node.node_runtime import NodeRuntime
from pdserve.shared.engine.engine import RemoteReservation
from pdserve.shared.types import BlockHash


class KVReservation:
    """One reservation's blocks (`blocks`: None once ended, or when the pool had no room)."""

    def __init__(self, reservations: Reservations | None = None, blocks: RemoteReservation | None = None):
        self._reservations = reservations
        self._blocks = blocks

    @property
    def blocks(self) -> RemoteReservation | None:
        return self._blocks

    def take(self) -> RemoteReservation:
        """The blocks, handed over to whoever ends them now (the engine's admission); releasing the handle
        afterwards releases nothing."""
        blocks, self._blocks = self._blocks, None
        assert blocks is not None, "take() of a reservation that holds nothing"
        return blocks

    async def release(self) -> None:
        """Gives the blocks back on the engine thread, once; shielded: a cancelled caller still frees them."""
        blocks, self._blocks = self._blocks, None
        if blocks is not None:
            assert self._reservations is not None, "a handle holding blocks has its node's reservations"
            await asyncio.shield(self._reservations.give_back(blocks))


class Reservations:
    """Makes this node's `KVReservation`s on its engine thread and finishes the releases their callers
    could not wait for."""

    def __init__(self, rt: NodeRuntime) -> None:
        self.rt = rt
        self._background: set[asyncio.Future[Any]] = set()

    async def reserve(
        self, hashes: Sequence[BlockHash], num_blocks: int, *, headroom: bool = False
    ) -> KVReservation:
        """Reserves a prompt of `num_blocks` blocks (LLMEngine.reserve_remote); a handle holding nothing when
        the pool has no room now. Cancellation-safe: what the engine reserves for a cancelled caller goes
        back at once."""
        engine = self.rt.engine
        fut = asyncio.ensure_future(
            self.rt.aengine.call(lambda: engine.reserve_remote(hashes, num_blocks, headroom=headroom))
        )
        try:
            return KVReservation(self, await asyncio.shield(fut))
        except asyncio.CancelledError:
            fut.add_done_callback(self._release_orphan)
            raise

    async def give_back(self, blocks: RemoteReservation) -> None:
        engine = self.rt.engine
        await self.rt.aengine.call(lambda: engine.release_remote(blocks))

    def _release_orphan(self, fut: asyncio.Future[RemoteReservation | None]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        blocks = fut.result()
        if blocks is not None:
            task = asyncio.ensure_future(self.give_back(blocks))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
