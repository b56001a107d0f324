"""The fleet's admission ledger (router/ledger_redis.py over shared/index/lease_table.py) against a real
redis-server: two ledgers stand for two routers of one cluster. The cap holds across them, a booking ends
exactly once, a dead router's leases expire within the lease TTL, and with Redis gone a router admits by
its own counts (and says so on its metrics) instead of blocking."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import redis.asyncio
from pdserve.cli.redis_launch import LocalRedis, free_port
from pdserve.router.admission import AdmissionConfig, NodeFull
from pdserve.router.background import Background
from pdserve.router.ledger_redis import RedisLedger
from pdserve.router.metrics import RouterMetrics
from pdserve.shared.index.block_index_types import RedisConfig
from pdserve.shared.index.lease_table import LeaseTable
from pdserve.shared.types import NodeId

D, P = NodeId("decode-0"), NodeId("prefill-0")


@pytest.fixture(scope="module")
def redis_server() -> Iterator[LocalRedis]:
    with LocalRedis() as server:
        yield server


def _ledger(url: str, cap: int, ttl_s: float = 3.0, cluster: str = "x") -> tuple[RedisLedger, RouterMetrics]:
    metrics = RouterMetrics()
    config = AdmissionConfig(max_requests_per_node=cap, fleet=True, lease_ttl_s=ttl_s)
    table = LeaseTable(RedisConfig(url=url, cluster=cluster, socket_timeout_s=0.5))
    return RedisLedger(config, table, metrics, Background()), metrics


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
        await a.start()
        await b.start()
        try:
            first = (await a.acquire(D, P, 100, 1))[0]
            second = (await b.acquire(D, P, 50, 1))[0]
            with pytest.raises(NodeFull):  # two routers, one place each: the fleet's cap of 2 is reached
                await a.acquire(D, P, 10, 1)
            assert a.full(D)  # the refusal tells the node it found full
            a.full(P)  # a node the router looks at is in its next read of the fleet's counts
            await a.wait_for_room(time.time() + 1)  # no room comes: returns after one poll and a read
            assert a.full(P) and a.load(P).prefill_tokens == 150  # the fleet's: the routing score reads them
            second.prefill_done()
            await b._background.drain()
            assert await _live_leases(redis_server.url, "cap", P) == 1
            assert await _live_leases(redis_server.url, "cap", D) == 2
            second.release()
            second.release()  # exactly once: a second release gives back nothing
            await b._background.drain()
            assert await _live_leases(redis_server.url, "cap", D) == 1
            await a.wait_for_room(time.time() + 5)  # re-reads the fleet's counts
            assert not a.full(D)
            third = (await a.acquire(D, P, 10, 1))[0]
            with pytest.raises(NodeFull):
                await b.acquire(D, None, 10, 1)
            for booking in (first, third):
                booking.release()
            await a._background.drain()
            assert await _live_leases(redis_server.url, "cap", D) == 0
        finally:
            await a.close()
            await b.close()

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
        await ledger.start()
        try:
            booking = (await ledger.acquire(D, None, 5, 1))[0]  # Redis refuses: booked locally, no wait
            page = metrics.render().decode()
            assert "pdserve_router_admission_fleet_degraded 1.0" in page
            assert "pdserve_router_admission_local_fallbacks_total 1.0" in page
            assert ledger.full(D)  # the local cap still holds
            booking.release()
            assert not ledger.full(D)
        finally:
            await ledger.close()

    asyncio.run(scenario())


def test_the_fleet_admits_in_arrival_order_whichever_router_a_waiter_is_on(redis_server: LocalRedis) -> None:
    async def scenario() -> None:
        (a, _), (b, _) = (_ledger(redis_server.url, 1, 0.6, cluster="fifo") for _ in range(2))
        await a.start()
        await b.start()
        try:
            held = (await a.acquire(D, None, 5, 1))[0]
            with b.turn() as waiting:
                with pytest.raises(NodeFull):
                    await b.acquire(D, None, 5, 1, waiting)
                await b.wait_for_room(time.time() + 1, waiting)  # b's placement queues from here
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
        finally:
            await a.close()
            await b.close()

    asyncio.run(scenario())
