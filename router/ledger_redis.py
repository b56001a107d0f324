"""The fleet's in-flight ledger (`InFlight`, router/admission.py) for `--admission redis`: every router of a
cluster books its placements as leases in Redis (shared/index/lease_table.py), so `--max-requests-per-node`
holds for the fleet, and the routing score and the cost model read the fleet's counts.

How: a placement books its leases with one script that refuses a node at its cap (NodeFull: the router
looks again and waits). Each router refreshes all its live leases in one call every third of the lease TTL
(3 s by default), so the leases of a router that dies free within that TTL. A booking ends exactly once
(`release`, `prefill_done`, as the local ledger's) and its leases are removed in the background.
Fairness: a placement that has to wait takes a ticket in the fleet's queue in Redis (its arrival on
Redis's clock); a booking goes through only if fewer tickets are older than its own than the node has free
places, so the fleet admits in arrival order, whichever router a waiter is on. Each router reads the
queue's head (the tickets that may book now) when it frees a place and at least every _POLL_S, and wakes
only its own waiters at the head: every turn is somebody's, none starves, and a free place costs a
retry only of those whose turn it may be. A dead router's tickets expire with its leases. With several
nodes of a role, an older waiter for a full node can hold a younger one back from a free node
(head-of-line) for as long as the older one waits.
Redis down: the router falls back to its own counts and caps (this router's local ledger) until a refresh
succeeds again, counts the bookings it made so, and shows `pdserve_router_admission_fleet_degraded` 1;
nothing waits on Redis longer than its socket timeout. Waiting placements wait in one queue either way,
woken on the failure and on the recovery (they look again by the other counts): a placement that began to
wait while degraded is not left to this router's own releases, of which there may be none (a fleet run
hung so after a Redis stall, every node empty).
Invariants: this router's own counts (`_local`) include every live booking, fleet or fallback; the fleet's
counts (`_fleet`) are the last ones Redis answered, lowered at once by this router's own releases; a node
is full when either says so (only the local counts while degraded).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass

from pdserve.router.admission import (
    AdmissionConfig,
    Booking,
    InFlight,
    Ledger,
    Load,
    NodeFull,
    OnceBooking,
    Turn,
    booked_view,
    refuse_when_queue_full,
)
from pdserve.router.background import Background
from pdserve.router.errors import NoRoom
from pdserve.router.policy import NodeView
from pdserve.shared.index.block_index_types import IndexUnavailable, RedisConfig
from pdserve.shared.index.lease_table import (
    LeaseTable,
    NodeLeases,
    lease_member,
    ticket_entries,
    tokens_member,
)
from pdserve.shared.metrics import MetricsRegistry
from pdserve.shared.types import NodeId

log = logging.getLogger(__name__)

_POLL_S = 0.05
"""How often a waiting placement re-reads the fleet's counts (one read shared by this router's waiters)."""

Member = tuple[str, str]
"""A lease table entry: (key suffix, member)."""


@dataclass(eq=False)
class _Lease(OnceBooking):
    """One choice's booking: this router's own (`_inner`) and, unless booked while degraded, its leases."""

    _ledger: RedisLedger
    _inner: Booking
    _decode: NodeId
    _decode_member: Member | None
    _prefill_members: tuple[Member, ...]
    _prefill: NodeId | None

    def _end_prefilling(self) -> None:
        self._inner.prefill_done()
        self._ledger._ended(self._prefill_members, self._prefill)

    def _end_rest(self) -> None:
        self._inner.release()
        self._ledger._ended(() if self._decode_member is None else (self._decode_member,), self._decode)


class RedisLedger:
    """The fleet's ledger as one router sees it (`InFlight`)."""

    def __init__(
        self, config: AdmissionConfig, table: LeaseTable, metrics: MetricsRegistry, background: Background
    ) -> None:
        self.config = config
        self._table = table
        self._background = background
        self._local = Ledger(config)
        self._fleet: dict[NodeId, Load] = {}
        self._seen: set[NodeId] = set()
        self._held: dict[Member, None] = {}
        """This router's live lease entries (insertion-ordered set): what the refresh extends."""
        self._releasing: list[Member] = []
        """Entries of ended bookings not yet deleted from Redis (one flush at a time deletes them)."""
        self._flushing = False
        # host and pid name the router whose leases they are (kvctl, a test checking a killed router's)
        self._router = f"{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(3)}"
        self._seq = 0
        self._degraded = False
        self._loop: asyncio.Task[None] | None = None
        self._poller: asyncio.Task[None] | None = None
        self._waiting: list[tuple[int, int, asyncio.Future[None], str | None]] = []
        """Placements waiting for room, by arrival (a placement sent back keeps its first arrival), with
        their tickets."""
        self._nudge = asyncio.Event()
        self._stopping = asyncio.Event()
        """Set by close(): the loops end."""
        """Set when this router frees a place: the poller reads the queue now, not at its next poll."""
        self._arrival: dict[str, int] = {}
        """A waiting placement's ticket -> its arrival order in this router."""
        self._ttl_ms = int(config.lease_ttl_s * 1000)
        self._degraded_gauge = metrics.gauge(
            "pdserve_router_admission_fleet_degraded",
            "1 while the fleet's admission ledger in Redis is unreachable and this router admits by its own "
            "counts alone (the caps then hold per router), else 0.",
        )
        self._fallbacks = metrics.counter(
            "pdserve_router_admission_local_fallbacks",
            "Bookings made by this router's own counts because the fleet's ledger in Redis failed.",
        )

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def load(self, node_id: NodeId) -> Load:
        self._seen.add(node_id)
        own = self._local.load(node_id)
        if self._degraded:
            return own
        fleet = self._fleet.get(node_id, Load())
        return Load(max(own.requests, fleet.requests), max(own.prefill_tokens, fleet.prefill_tokens))

    def view(self, node: NodeView) -> NodeView:
        count = self.load(node.node_id)
        return node if count == Load() else booked_view(node, count)

    def full(self, node_id: NodeId) -> bool:
        limit = self.config.max_requests_per_node
        return limit > 0 and self.load(node_id).requests >= limit

    def turn(self) -> Turn:
        return Turn(ended=self._turn_ended)

    async def acquire(
        self, decode: NodeId, prefill: NodeId | None, prefill_tokens: int, n: int, turn: Turn | None = None
    ) -> tuple[Booking, ...]:
        if self._degraded:
            return self._fallback(decode, prefill, prefill_tokens, n)
        self._seen.update(n for n in (decode, prefill) if n is not None)
        base = self._next_id()
        ticket = None if turn is None else turn.ticket
        cap = self.config.max_requests_per_node
        try:
            booked = await self._table.book(
                self._ttl_ms, cap, n, base, prefill_tokens, decode, prefill, ticket
            )
        except IndexUnavailable as exc:
            self._degrade(exc)
            return self._fallback(decode, prefill, prefill_tokens, n)
        self._note(booked.counts)
        if booked.full is not None:
            raise NodeFull(booked.full)
        if turn is not None and turn.ticket is not None:  # the booking took it out of the queue
            self._held.pop(ticket_entries(turn.ticket)[1], None)
            self._arrival.pop(turn.ticket, None)
            turn.ticket = None
        prefilling = decode if prefill is None else prefill
        leases = []
        for i in range(1, n + 1):
            lease = f"{base}:{i}"
            decode_member = (lease_member(decode), lease)
            prefill_members = [(tokens_member(prefilling), f"{lease}|{prefill_tokens}")]
            if prefill is not None:
                prefill_members.append((lease_member(prefill), lease))
            for member in (decode_member, *prefill_members):
                self._held[member] = None
            inner = self._local.book(decode, prefill, prefill_tokens)
            leases.append(_Lease(self, inner, decode, decode_member, tuple(prefill_members), prefill))
        return tuple(leases)

    def _fallback(
        self, decode: NodeId, prefill: NodeId | None, prefill_tokens: int, n: int
    ) -> tuple[Booking, ...]:
        self._fallbacks.inc(n)
        books = (self._local.book(decode, prefill, prefill_tokens) for _ in range(n))
        return tuple(_Lease(self, inner, decode, None, (), prefill) for inner in books)

    async def wait_for_room(self, deadline: float, turn: Turn | None = None) -> None:
        refuse_when_queue_full(self.config, len(self._waiting))
        self._seq += 1
        order = self._seq
        if turn is not None and turn.ticket is None and not self._degraded:  # it waits in the fleet's queue
            turn.ticket = self._next_id()
            self._arrival[turn.ticket] = order
            try:
                await self._table.enqueue(self._ttl_ms, turn.ticket)
                self._held[ticket_entries(turn.ticket)[1]] = None
            except IndexUnavailable as exc:
                self._degrade(exc)
        if turn is not None and turn.ticket is not None:
            order = self._arrival.get(turn.ticket, order)  # a placement sent back keeps its place in line
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (order, id(waiter), waiter, None if turn is None else turn.ticket)
        bisect.insort(self._waiting, entry)
        try:
            async with asyncio.timeout(max(0.0, deadline - time.time())):
                await waiter
        except TimeoutError:
            message = "no node had room before the request's deadline"
            raise NoRoom(message, self.config.retry_after_s) from None
        finally:
            with contextlib.suppress(ValueError):
                self._waiting.remove(entry)

    async def start(self) -> None:
        self._loop = asyncio.create_task(self._refresh_loop())
        self._poller = asyncio.create_task(self._poll_loop())

    async def close(self) -> None:
        # The loops stop at this signal, after the Redis call in flight (bounded by its socket timeout), not
        # by cancellation: redis-py sends a command through asyncio.wait_for, which on Python 3.11 loses a
        # cancellation that arrives as the send completes (CPython gh-86296, fixed in 3.12), and close()
        # then waited forever for a loop that went on (benchmarks/fleet_ledger.py hung at its end so).
        self._stopping.set()
        self._nudge.set()
        await asyncio.gather(*(task for task in (self._loop, self._poller) if task is not None))
        await self._background.drain()  # deletions in flight end before the connections close
        with contextlib.suppress(IndexUnavailable):  # else they expire within the TTL
            await self._table.release([*self._held, *self._releasing])
        await self._table.close()

    # --- inside ---------------------------------------------------------------------------------------------

    def _next_id(self) -> str:
        self._seq += 1
        return f"{self._router}:{self._seq}"

    def _turn_ended(self, turn: Turn) -> None:
        """A placement ended (booked, refused, cancelled): a ticket it still holds leaves the queue."""
        if turn.ticket is not None:
            self._arrival.pop(turn.ticket, None)
            entries = ticket_entries(turn.ticket)
            self._held.pop(entries[1], None)
            self._background.spawn(self._remove(entries))
            turn.ticket = None

    def _ended(self, members: tuple[Member, ...], node: NodeId | None) -> None:
        """A booking's part ended: its lease entries leave the refresh and Redis; the node's fleet count
        drops at once, so this router's waiters need not wait for the next read to see the place."""
        for member in members:
            self._held.pop(member, None)
        if node is not None:
            if node in self._fleet:
                old = self._fleet[node]
                self._fleet[node] = Load(max(0, old.requests - 1), old.prefill_tokens)
            if self._degraded:
                self._wake(1)  # by this router's own counts: its longest-waiting placement
            else:
                self._nudge.set()  # the fleet's queue decides whose turn it is
        if not members:  # booked while degraded: nothing in Redis
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # ended outside the event loop (a dropped response finalized by the GC): its
            return  # leases are no longer refreshed and expire within the TTL
        self._releasing.extend(members)
        if not self._flushing:
            self._flushing = True
            self._background.spawn(self._flush())

    async def _flush(self) -> None:
        """Deletes the ended leases in batches: one call for all that ended since the last one."""
        try:
            while self._releasing:
                batch, self._releasing = tuple(self._releasing), []
                await self._remove(batch)
        finally:
            self._flushing = False

    async def _remove(self, members: tuple[Member, ...]) -> None:
        try:
            await self._table.release(members)
        except IndexUnavailable as exc:  # the leases expire within the TTL
            self._degrade(exc)

    def _note(self, counts: dict[NodeId, NodeLeases]) -> None:
        for node, c in counts.items():
            self._fleet[node] = Load(c.requests, c.prefill_tokens)

    def _degrade(self, exc: IndexUnavailable) -> None:
        if not self._degraded:
            log.warning("fleet admission ledger unreachable (%s): admitting by this router's own counts", exc)
            self._degraded = True
            self._degraded_gauge.set(1)
            self._wake(len(self._waiting))  # they look again, by this router's counts

    def _wake(self, n: int) -> None:
        """Wakes the `n` longest-waiting placements (they look for room and book, or wait again)."""
        woken = 0
        for _, _, waiter, _ in self._waiting:
            if woken >= n:
                break
            if not waiter.done():
                waiter.set_result(None)
                woken += 1

    def _wake_turns(self, head: frozenset[str]) -> None:
        """Wakes the waiting placements whose turn it is: those with a ticket at the head of the fleet's
        queue, and those without one (it could not be queued) when some node has a free place."""
        cap = self.config.max_requests_per_node
        room = any(self.load(node).requests < cap for node in list(self._seen))
        for _, _, waiter, ticket in self._waiting:
            if not waiter.done() and (ticket in head if ticket is not None else room):
                waiter.set_result(None)

    async def _poll_loop(self) -> None:
        """While placements wait: the fleet's counts and the head of its queue, read when this router frees
        a place and at least every _POLL_S (for other routers' frees); each router wakes only its waiters
        at the head. Not every waiter on a free place: all but one of them were refused (a retry storm of
        53,874 refused bookings for 1,500 placements); nor this router's own oldest: its order is not the
        fleet's, and that starved the placements whose turn it was (a three-router run stalled)."""
        cap = self.config.max_requests_per_node
        while not self._stopping.is_set():
            await _until(self._nudge, _POLL_S)
            self._nudge.clear()
            if self._stopping.is_set() or not self._waiting or self._degraded:
                continue
            try:
                look = await self._table.look(sorted(self._seen), cap)
            except IndexUnavailable as exc:
                self._degrade(exc)
                continue
            self._note(look.counts)
            self._wake_turns(look.head)

    async def _refresh_loop(self) -> None:
        """Every third of the TTL: extend this router's leases (one call) and read the fleet's counts; the
        first success after a failure ends the fallback."""
        while not self._stopping.is_set():
            await _until(self._stopping, self.config.lease_ttl_s / 3)
            if self._stopping.is_set():
                return
            try:
                await self._table.refresh(self._ttl_ms, list(self._held))
                self._note(await self._table.counts(sorted(self._seen)))
            except IndexUnavailable as exc:
                self._degrade(exc)
                continue
            if self._degraded:
                log.warning("fleet admission ledger reachable again: admitting by the fleet's counts")
                self._degraded = False
                self._degraded_gauge.set(0)
                self._wake(len(self._waiting))  # they look again, by the fleet's counts


async def _until(event: asyncio.Event, seconds: float) -> None:
    """Waits until `event` is set or `seconds` have passed."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()


def ledger_for(
    config: AdmissionConfig, redis: RedisConfig, metrics: MetricsRegistry, background: Background
) -> InFlight:
    """The fleet's ledger with `config.fleet` (`--admission redis`), else this router's own."""
    if config.fleet:
        return RedisLedger(config, LeaseTable(redis), metrics, background)
    return Ledger(config)
