"""The one in-flight ledger of the router: the work it placed on each node and has not seen end, and the
admission gate in front of placement that reads it.

Heartbeat loads are up to a second old, so a burst placed within that second would see one snapshot and herd
onto one node. Each placed choice therefore books its predicted load at once (`InFlight.book`): one request
on the decoding node until the choice ends on any path; one request on the prefill node (P/D) and the prompt
tokens the decision predicts the prefilling node (P, or D when it prefills) computes, until that node's part
ends (`Booking.prefill_done`: P's reply, or the first token). Both readers use the same counts: the policy
sees, per node, the larger of the heartbeat's load and this router's; the cost model's queue depths are this
router's counts alone (fresher than heartbeats, whose stale queues made its estimates err).

Admission: with `AdmissionConfig.max_requests_per_node` set, a node holding that many of this router's
requests takes no more. A request that finds every node of a needed role at the limit waits, first come
first served, for a booking to end; at most `max_queued` requests wait, and none past its deadline. Beyond
the queue it is refused with 429 and Retry-After before anything was sent to a node or streamed to the
client: an admitted request never fails for load.

Invariants: a Booking gives back exactly what it took, once (`release` and `prefill_done` are idempotent;
`release` includes `prefill_done`; `OnceBooking` keeps that for both ledgers); counts never go negative and
a node with nothing booked has no entry; waiters are woken in arrival order, one per booking that ends.
`InFlight` is the seam both ledgers implement: `Ledger` is this process's own (`--admission local`, one
router); router/ledger_redis.py's is the fleet's, leases in Redis shared by every router of a cluster
(`--admission redis`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Protocol

from pdserve.router.errors import NoRoom, QueueFull
from pdserve.router.policy import NodeView
from pdserve.shared.types import NodeId


@dataclass(frozen=True)
class AdmissionConfig:
    max_requests_per_node: int = 0
    """Requests this router keeps in flight on one node at most (0: no limit, nothing ever waits)."""
    max_queued: int = 1024
    """Requests that may wait for room at once; beyond it the router answers 429."""
    retry_after_s: int = 1
    """The Retry-After a refused client gets."""
    fleet: bool = False
    """The caps hold for every router of the cluster (leases in Redis, router/ledger_redis.py), not for this
    router alone."""
    lease_ttl_s: float = 3.0
    """A fleet lease's life after its router's last refresh (refreshed every third of it): how long the
    leases of a router that died keep their places."""

    def __post_init__(self) -> None:
        if self.max_requests_per_node < 0 or self.max_queued < 0 or self.retry_after_s < 1:
            raise ValueError(f"admission limits must be >= 0 (retry_after_s >= 1), got {self}")
        if self.lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {self.lease_ttl_s}")


def refuse_when_queue_full(config: AdmissionConfig, waiting: int) -> None:
    """Raises QueueFull (429 with Retry-After) when `waiting` requests already fill the queue."""
    if waiting >= config.max_queued:
        raise QueueFull(
            f"every node is at its limit of {config.max_requests_per_node} requests and {waiting} requests "
            "are waiting; retry later",
            config.retry_after_s,
        )


class NodeFull(Exception):
    """A booking found `node_id` at its cap (another router of the fleet filled it since the last look)."""

    def __init__(self, node_id: NodeId) -> None:
        super().__init__(f"node {node_id} is at its in-flight limit")
        self.node_id = node_id


@dataclass(frozen=True)
class Load:
    """What is booked on one node: requests, and prompt tokens predicted to be computed there, not yet."""

    requests: int = 0
    prefill_tokens: int = 0


class Booking(Protocol):
    """One choice's booked load; the holder gives it back (a context manager: `release` on exit, which the
    ledgers' bookings inherit from here)."""

    def prefill_done(self) -> None:
        """The prefilling node's part is over: its tokens (and P's request) are no longer this choice's."""

    def release(self) -> None:
        """Everything the booking holds is given back (idempotent)."""

    def __enter__(self) -> Booking:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


@dataclass(eq=False)
class Turn:
    """One placement's place in line while it waits for room, held for the placement's whole life
    (`with ledger.turn() as turn`). The fleet's ledger keeps the placement's ticket in its queue here (the
    arrival order across routers) and gives it up when the turn ends; the local ledger needs none."""

    ticket: str | None = None
    ended: Callable[[Turn], None] | None = None

    def __enter__(self) -> Turn:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.ended is not None:
            self.ended(self)


class InFlight(Protocol):
    """The in-flight ledger as placement, admission and the cost model's inputs read it."""

    @property
    def queued(self) -> int:
        """Placements waiting for room."""

    def load(self, node_id: NodeId) -> Load: ...

    def view(self, node: NodeView) -> NodeView:
        """The node as the policy should see it: the heartbeat's load, or the booked one if larger."""

    def full(self, node_id: NodeId) -> bool: ...

    def turn(self) -> Turn:
        """A placement's place in line (a context manager around the placement)."""

    async def acquire(
        self, decode: NodeId, prefill: NodeId | None, prefill_tokens: int, n: int, turn: Turn | None = None
    ) -> tuple[Booking, ...]:
        """n bookings of one request on `decode`; and one request on `prefill` (P/D) with `prefill_tokens`
        on the prefilling node (`prefill`, or `decode` when it prefills) until `prefill_done`. NodeFull when
        a node turned out to be at its cap, or placements that waited longer must go first (nothing is
        booked then: wait for room, then place again)."""

    async def wait_for_room(self, deadline: float, turn: Turn | None = None) -> None:
        """Waits for some booking to end; QueueFull when the queue is full, NoRoom at the deadline."""

    async def start(self) -> None:
        """Starts what the ledger runs in the background (a shared ledger's lease refresh)."""

    async def close(self) -> None:
        """Stops it and gives back what is still held where others can see it."""


def booked_view(node: NodeView, count: Load) -> NodeView:
    """The node with its heartbeat's load raised to what is booked on it (`count`), where that is larger."""
    waiting = max(node.waiting, count.requests - node.running)
    return replace(
        node, waiting=waiting, queued_prefill_tokens=max(node.queued_prefill_tokens, count.prefill_tokens)
    )


@dataclass(eq=False)
class OnceBooking(Booking):
    """A ledger's booking, given back in two parts, each exactly once on every path: `prefill_done` gives
    back the prefilling part, `release` (idempotent) the rest, after the prefilling part if that is still
    held. A ledger says what giving back each part means."""

    _prefilling_live: bool = field(default=True, init=False)
    _live: bool = field(default=True, init=False)

    def prefill_done(self) -> None:
        if self._prefilling_live:
            self._prefilling_live = False
            self._end_prefilling()

    def release(self) -> None:
        if self._live:
            self._live = False
            self.prefill_done()
            self._end_rest()

    def _end_prefilling(self) -> None:
        raise NotImplementedError

    def _end_rest(self) -> None:
        raise NotImplementedError


@dataclass(eq=False)
class _Booking(OnceBooking):
    _ledger: Ledger
    _decode: NodeId
    _prefill: NodeId | None
    _prefilling: NodeId
    _tokens: int

    def _end_prefilling(self) -> None:
        self._ledger._add(self._prefilling, 0, -self._tokens)
        if self._prefill is not None:
            self._ledger._end(self._prefill)

    def _end_rest(self) -> None:
        self._ledger._end(self._decode)


class Ledger:
    """This router's own in-flight ledger (`InFlight`), in process memory."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self._counts: dict[NodeId, Load] = {}
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def load(self, node_id: NodeId) -> Load:
        return self._counts.get(node_id, Load())

    def view(self, node: NodeView) -> NodeView:
        count = self._counts.get(node.node_id)
        return node if count is None else booked_view(node, count)

    def full(self, node_id: NodeId) -> bool:
        limit = self.config.max_requests_per_node
        return limit > 0 and self.load(node_id).requests >= limit

    def book(self, decode: NodeId, prefill: NodeId | None, prefill_tokens: int) -> Booking:
        assert prefill_tokens >= 0, f"prefill_tokens={prefill_tokens} must be >= 0"
        self._add(decode, 1, 0)
        if prefill is not None:
            self._add(prefill, 1, 0)
        prefilling = decode if prefill is None else prefill
        self._add(prefilling, 0, prefill_tokens)
        return _Booking(self, decode, prefill, prefilling, prefill_tokens)

    def turn(self) -> Turn:
        return Turn()

    async def acquire(
        self, decode: NodeId, prefill: NodeId | None, prefill_tokens: int, n: int, turn: Turn | None = None
    ) -> tuple[Booking, ...]:
        # never suspends: from the caller's room check to the bookings no other placement runs
        return tuple(self.book(decode, prefill, prefill_tokens) for _ in range(n))

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def wait_for_room(self, deadline: float, turn: Turn | None = None) -> None:
        refuse_when_queue_full(self.config, len(self._waiters))
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(max(0.0, deadline - time.time())):
                await waiter
        except TimeoutError:
            raise NoRoom(
                "no node had room before the request's deadline", self.config.retry_after_s
            ) from None
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def _add(self, node_id: NodeId, requests: int, tokens: int) -> None:
        old = self._counts.get(node_id, Load())
        count = Load(old.requests + requests, old.prefill_tokens + tokens)
        assert count.requests >= 0 and count.prefill_tokens >= 0, f"{node_id}: negative in-flight count"
        if count.requests or count.prefill_tokens:
            self._counts[node_id] = count
        else:
            self._counts.pop(node_id, None)

    def _end(self, node_id: NodeId) -> None:
        self._add(node_id, -1, 0)
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                break
