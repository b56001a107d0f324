"""The fleet's admission ledger (router/ledger_redis.py over shared/index/lease_table.py) against a real
redis-server: two ledgers stand for two routers of one cluster. The cap holds across them, a booking ends
exactly once, a dead router's leases expire within the lease TTL, and with Redis gone a router admits by
its own counts (and says so on its metrics) instead of blocking; a state machine checks Redis's counts
against a model of every live booking under any interleaving of two routers' bookings and releases."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest
import redis.asyncio
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from pdserve.cli.redis_launch import LocalRedis, free_port
from pdserve.router.admission import AdmissionConfig, NodeFull
from pdserve.router.background import Background
from pdserve.router.errors import NoRoom
from pdserve.router.ledger_redis import RedisLedger
from pdserve.router.metrics import RouterMetrics
from pdserve.shared.index.block_index_types import RedisConfig
from pdserve.shared.index.lease_table import LeaseTable, NodeLeases
from pdserve.shared.types import NodeId
from pdserve.tests.harness.bookings import Held, expected_load

D, P = NodeId("decode-0"), NodeId("prefill-0")
NODES = tuple(NodeId(n) for n in ("p0", "p1", "d0", "d1"))
CAP = 3
T = TypeVar("T")


@pytest.fixture(scope="module")
def redis_server() -> Iterator[LocalRedis]:
    with LocalRedis() as server:
        yield server


def _ledger(
    url: str, cap: int, ttl_s: float = 3.0, cluster: str = "x", connections: int = 64
) -> tuple[RedisLedger, RouterMetrics]:
    metrics = RouterMetrics()
    config = AdmissionConfig(max_requests_per_node=cap, fleet=True, lease_ttl_s=ttl_s)
    redis_config = RedisConfig(url=url, cluster=cluster, socket_timeout_s=0.5, max_connections=connections)
    table = LeaseTable(redis_config)
    return RedisLedger(config, table, metrics, Background()), metrics


@contextlib.asynccontextmanager
async def _running(*ledgers: RedisLedger) -> AsyncIterator[None]:
    """The ledgers started, as their routers' are; each closed on every path."""
    async with contextlib.AsyncExitStack() as stack:
        for ledger in ledgers:
            await ledger.start()
            stack.push_async_callback(ledger.close)
        yield


async def _live_leases(url: str, cluster: str, node: NodeId) -> int:
    """Leases of `node` that have not expired, on Redis's clock."""
    client = redis.asyncio.Redis.from_url(url)
    try:
        seconds, micros = await client.time()
        now_ms = seconds * 1000 + micros // 1000
        return int(await client.zcount(f"pdserve:{{{cluster}}}:lease:{node}", now_ms, "+inf"))
    finally:
        await client.aclose()


def test_the_cap_holds_across_routers_and_a_release_frees_one_place_once(redis_server: LocalRedis) -> None:
    async def scenario() -> None:
        (a, _), (b, _) = (_ledger(redis_server.url, 2, cluster="cap") for _ in range(2))
        async with _running(a, b):
            first = (await a.acquire(D, P, 100, 1))[0]
            second = (await b.acquire(D, P, 50, 1))[0]
            with pytest.raises(NodeFull):  # two routers, one place each: the fleet's cap of 2 is reached
                await a.acquire(D, P, 10, 1)
            assert a.full(D)  # the refusal tells the node it found full
            a.full(P)  # a node the router looks at is in its next read of the fleet's counts
            with pytest.raises(NoRoom):  # no room comes; meanwhile the router reads the fleet's counts
                await a.wait_for_room(time.time() + 0.3)
            assert a.full(P) and a.load(P).prefill_tokens == 150  # the fleet's: the routing score reads them
            second.prefill_done()
            await b._background.drain()
            assert await _live_leases(redis_server.url, "cap", P) == 1
            assert await _live_leases(redis_server.url, "cap", D) == 2
            second.release()
            second.release()  # exactly once: a second release gives back nothing
            await b._background.drain()
            assert await _live_leases(redis_server.url, "cap", D) == 1
            await a.wait_for_room(time.time() + 5)  # woken once the fleet's counts show the free place
            assert not a.full(D)
            third = (await a.acquire(D, P, 10, 1))[0]
            with pytest.raises(NodeFull):
                await b.acquire(D, None, 10, 1)
            for booking in (first, third):
                booking.release()
            await a._background.drain()
            assert await _live_leases(redis_server.url, "cap", D) == 0

    asyncio.run(scenario())


def test_a_dead_routers_leases_expire_within_the_ttl_while_a_live_ones_are_refreshed(
    redis_server: LocalRedis,
) -> None:
    async def scenario() -> None:
        (alive, _), (dead, _) = (_ledger(redis_server.url, 4, 0.6, "ttl") for _ in range(2))
        await alive.start()
        held = await alive.acquire(D, None, 5, 2)
        await dead.acquire(D, None, 5, 1)  # its refresh loop never runs: as a router killed with -9
        assert await _live_leases(redis_server.url, "ttl", D) == 3
        await asyncio.sleep(1.8)  # three TTLs: the dead router's lease is gone, the live one's refreshed
        assert await _live_leases(redis_server.url, "ttl", D) == 2
        for booking in held:
            booking.release()
        await alive.close()
        assert await _live_leases(redis_server.url, "ttl", D) == 0

    asyncio.run(scenario())


def test_without_redis_a_router_admits_by_its_own_counts_and_says_so() -> None:
    async def scenario() -> None:
        ledger, metrics = _ledger(f"redis://127.0.0.1:{free_port()}/0", 1, cluster="down")
        async with _running(ledger):
            booking = (await ledger.acquire(D, None, 5, 1))[0]  # Redis refuses: booked locally, no wait
            page = metrics.render().decode()
            assert "pdserve_router_admission_fleet_degraded 1.0" in page
            assert "pdserve_router_admission_local_fallbacks_total 1.0" in page
            assert ledger.full(D)  # the local cap still holds
            booking.release()
            assert not ledger.full(D)

    asyncio.run(scenario())


def test_a_placement_that_began_waiting_while_redis_stalled_is_woken_once_it_answers_again(
    redis_server: LocalRedis,
) -> None:
    """A Redis stall (here CLIENT PAUSE; on a loaded machine, a reply slower than the socket timeout) makes
    a router admit by its own counts for a while. A placement refused by the fleet that starts waiting then
    must still be woken when Redis answers again and the fleet frees a place, though this router itself
    holds nothing that could end (benchmarks/fleet_ledger.py hung so: hundreds of placements waiting with
    every node empty)."""

    async def scenario() -> None:
        (a, _), (b, _) = (_ledger(redis_server.url, 1, 0.6, cluster="stall") for _ in range(2))
        async with redis.asyncio.Redis.from_url(redis_server.url) as control, _running(a, b):
            held = (await b.acquire(D, None, 5, 1))[0]
            with a.turn() as turn:
                with pytest.raises(NodeFull):
                    await a.acquire(D, None, 5, 1, turn)
                await control.execute_command("CLIENT", "PAUSE", 1500, "ALL")
                while not a._degraded:  # a's lease refresh times out: it admits by its own counts
                    await asyncio.sleep(0.05)
                waiting = asyncio.create_task(a.wait_for_room(time.time() + 8, turn))
                while a._degraded:  # Redis answers again
                    await asyncio.sleep(0.05)
                held.release()  # the fleet's place frees; a holds nothing of its own that could end
                await waiting  # NoRoom at the deadline before the fix
                (await a.acquire(D, None, 5, 1, turn))[0].release()

    asyncio.run(scenario())


def test_the_fleet_admits_in_arrival_order_whichever_router_a_waiter_is_on(redis_server: LocalRedis) -> None:
    async def scenario() -> None:
        (a, _), (b, _) = (_ledger(redis_server.url, 1, 0.6, cluster="fifo") for _ in range(2))
        async with _running(a, b):
            held = (await a.acquire(D, None, 5, 1))[0]
            with b.turn() as waiting:
                with pytest.raises(NodeFull):
                    await b.acquire(D, None, 5, 1, waiting)
                with pytest.raises(NoRoom):  # b's placement queues from here
                    await b.wait_for_room(time.time() + 0.3, waiting)
                await asyncio.sleep(1.5)  # waiting longer than the TTL: the refresh keeps its place
                held.release()
                await a._background.drain()
                with a.turn() as late, pytest.raises(NodeFull):  # a place is free, but b waited first
                    await a.acquire(D, None, 5, 1, late)
                first = (await b.acquire(D, None, 5, 1, waiting))[0]
            first.release()
            await b._background.drain()
            with a.turn() as turn:  # the queue is empty again: the next placement books at once
                (await a.acquire(D, None, 5, 1, turn))[0].release()

    asyncio.run(scenario())


def test_more_placements_at_once_than_redis_connections_never_fall_back(redis_server: LocalRedis) -> None:
    """redis-py's pool refuses a call when all its connections are busy ("Too many connections"): a burst of
    placements must wait for a connection, not take Redis for down and admit by one router's counts."""

    async def scenario() -> None:
        ledger, metrics = _ledger(redis_server.url, 0, cluster="burst", connections=4)

        async def place(i: int) -> None:
            (booking,) = await ledger.acquire(NODES[2 + i % 2], NODES[i % 2], 100, 1)
            await asyncio.sleep(0)
            booking.prefill_done()
            booking.release()

        async with _running(ledger):
            await asyncio.gather(*(place(i) for i in range(200)))
            await ledger._background.drain()
            page = metrics.render().decode()
            assert "pdserve_router_admission_local_fallbacks_total 0.0" in page
            assert "pdserve_router_admission_fleet_degraded 0.0" in page
            counts = await ledger._table.counts(list(NODES))
            assert all(c == NodeLeases() for c in counts.values()), counts

    asyncio.run(scenario())


class FleetMachine(RuleBasedStateMachine):
    """Two routers' ledgers over one Redis against a model of what each live booking holds: after every
    step the leases Redis counts per node are the model's, never above the cap, and a booking is refused
    exactly when one of its nodes holds the cap already."""

    bookings = Bundle("bookings")
    url = ""
    examples = itertools.count()

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        cluster = f"prop{next(self.examples)}"
        self.routers = [_ledger(self.url, CAP, cluster=cluster)[0] for _ in range(2)]
        self.held: list[Held] = []

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def in_loop(self, call: Callable[[], None]) -> None:
        """A booking's end, inside the event loop, as the router's requests end."""

        async def ended() -> None:
            call()

        self.run(ended())

    @rule(
        target=bookings,
        router=st.integers(0, 1),
        decode=st.sampled_from(NODES[2:]),
        prefill=st.none() | st.sampled_from(NODES[:2]),
        tokens=st.integers(0, 5000),
    )
    def acquire(self, router: int, decode: NodeId, prefill: NodeId | None, tokens: int) -> Held | None:
        full = self._requests(decode) >= CAP or (prefill is not None and self._requests(prefill) >= CAP)
        try:
            (booking,) = self.run(self.routers[router].acquire(decode, prefill, tokens, 1))
        except NodeFull:
            assert full
            return None
        assert not full
        held = Held(booking, decode, prefill, tokens)
        self.held.append(held)
        return held

    @rule(held=bookings)
    def prefill_done(self, held: Held | None) -> None:
        if held is not None:
            self.in_loop(held.booking.prefill_done)
            held.prefilling = False

    @rule(held=bookings)
    def release(self, held: Held | None) -> None:
        if held is not None:
            self.in_loop(held.booking.release)
            held.prefilling = held.live = False

    def _requests(self, node: NodeId) -> int:
        return expected_load(self.held, node)[0]

    @invariant()
    def redis_counts_are_the_models(self) -> None:
        for router in self.routers:
            self.run(router._background.drain())
        counts = self.run(self.routers[0]._table.counts(list(NODES)))
        for node in NODES:
            assert counts[node] == NodeLeases(*expected_load(self.held, node)), node
            assert counts[node].requests <= CAP

    def teardown(self) -> None:
        for held in self.held:
            self.in_loop(held.booking.release)
        for router in self.routers:
            self.run(router._background.drain())
        counts = self.run(self.routers[0]._table.counts(list(NODES)))
        assert all(c == NodeLeases() for c in counts.values()), counts
        for router in self.routers:
            self.run(router.close())
        self.loop.close()


def test_any_interleaving_of_two_routers_keeps_redis_counts_exact(redis_server: LocalRedis) -> None:
    FleetMachine.url = redis_server.url
    run_state_machine_as_test(
        FleetMachine, settings=settings(max_examples=25, stateful_step_count=25, deadline=None)
    )


def test_three_routers_placements_all_book_with_few_refusals_under_the_cap(redis_server: LocalRedis) -> None:
    """Under the cap a freed place wakes only the placements whose turn it is in the fleet's queue (its
    head), on whichever router they wait: every placement books (none starves), and a placement is
    refused about once (when it arrives to a full node), not once for every place freed while it waits."""

    async def scenario() -> None:
        ledgers = [_ledger(redis_server.url, 2, cluster="storm")[0] for _ in range(3)]
        per_router = 20
        refused = [0]

        async def place(ledger: RedisLedger) -> None:
            with ledger.turn() as turn:
                while True:
                    try:
                        (booking,) = await ledger.acquire(D, P, 10, 1, turn)
                        break
                    except NodeFull:
                        refused[0] += 1
                        await ledger.wait_for_room(time.time() + 60, turn)
            await asyncio.sleep(0.01)
            booking.prefill_done()
            booking.release()

        async with _running(*ledgers):
            await asyncio.gather(*(place(ledger) for ledger in ledgers for _ in range(per_router)))
            for ledger in ledgers:
                await ledger._background.drain()
            assert await _live_leases(redis_server.url, "storm", D) == 0
            # each placement but the first two is refused on arrival; waking every waiter on each free
            # place (before) refused them about 20 times each
            assert refused[0] <= 2 * per_router * len(ledgers), refused[0]

    asyncio.run(scenario())


def test_a_dead_routers_waiting_ticket_expires_and_holds_no_one_back(redis_server: LocalRedis) -> None:
    async def scenario() -> None:
        (alive, _), (dead, _) = (_ledger(redis_server.url, 1, 0.6, cluster="deadq") for _ in range(2))
        await alive.start()
        try:
            held = (await alive.acquire(D, None, 5, 1))[0]
            with dead.turn() as doomed:  # its router never refreshes: as one killed with -9 while it waited
                with pytest.raises(NodeFull):
                    await dead.acquire(D, None, 5, 1, doomed)
                with pytest.raises(NoRoom):
                    await dead.wait_for_room(time.time() + 0.05, doomed)
                doomed.ended = None  # killed: nothing takes its ticket out of the queue
            with alive.turn() as turn:
                with pytest.raises(NodeFull):
                    await alive.acquire(D, None, 5, 1, turn)
                held.release()
                await alive.wait_for_room(time.time() + 10, turn)  # the dead ticket expires within the TTL
                (await alive.acquire(D, None, 5, 1, turn))[0].release()
        finally:
            await alive.close()
            await dead._table.close()

    asyncio.run(scenario())


def test_close_returns_while_the_lease_refresh_is_talking_to_redis(redis_server: LocalRedis) -> None:
    """A router's close() stops its loops even when it lands while a loop sends to Redis (redis-py sends
    through asyncio.wait_for, which on Python 3.11 can lose a cancellation that arrives as the send
    completes: close() then waited forever; benchmarks/fleet_ledger.py hung at its end so)."""

    async def scenario() -> int | None:
        """The cycle whose close() did not return, or None."""
        for i in range(40):
            ledger, _ = _ledger(redis_server.url, 0, 0.003, cluster="close")  # a refresh every millisecond
            await ledger.start()
            await ledger.acquire(D, None, 5, 1)  # held: the refresh sends it; close() deletes it
            await asyncio.sleep(0.001 * (i % 7))
            closing = asyncio.create_task(ledger.close())
            done, _ = await asyncio.wait({closing}, timeout=20)
            if closing not in done:
                return i
        return None

    loop = asyncio.new_event_loop()  # not asyncio.run: its teardown would wait for a hung close() too
    try:
        assert loop.run_until_complete(scenario()) is None, "close() did not return"
    finally:
        loop.close()
