"""router/admission.py: the router's in-flight ledger and its admission queue, on plain data and asyncio.

The same limits through real processes: tests/test_router_overload.py."""

from __future__ import annotations

import asyncio
import time

import pytest
from pdserve.router.admission import AdmissionConfig, Ledger
from pdserve.router.errors import NoRoom, QueueFull, to_openai
from pdserve.router.policy import NodeView
from pdserve.shared.types import NodeId

P, D = NodeId("p"), NodeId("d")


def test_bookings_count_requests_and_prefill_tokens_until_released_once() -> None:
    ledger = Ledger(AdmissionConfig(max_requests_per_node=2))
    a = ledger.book(D, P, 100)
    b = ledger.book(D, P, 50)
    assert ledger.load(D).requests == ledger.load(P).requests == 2 and ledger.full(D)
    seen = ledger.view(NodeView(P, "prefill", running=1, waiting=0, queued_prefill_tokens=20))
    assert (seen.waiting, seen.queued_prefill_tokens) == (1, 150)  # the router's own count is larger
    fresh = ledger.view(NodeView(P, "prefill", running=5, waiting=3, queued_prefill_tokens=900))
    assert (fresh.waiting, fresh.queued_prefill_tokens) == (3, 900)  # the heartbeat's is larger
    a.prefill_done()
    a.prefill_done()
    assert ledger.view(NodeView(P, "prefill")).queued_prefill_tokens == 50
    assert ledger.load(P).requests == 1 and ledger.load(D).requests == 2  # P's part is over, D still decodes
    a.release()
    a.release()
    assert ledger.load(D).requests == 1 and not ledger.full(D)
    b.release()
    assert ledger.load(D).requests == ledger.load(P).requests == 0
    assert ledger.view(NodeView(P, "prefill")) == NodeView(P, "prefill")


def test_no_limit_means_never_full() -> None:
    ledger = Ledger(AdmissionConfig())
    for _ in range(1000):
        ledger.book(D, None, 10)
    assert not ledger.full(D)


def test_waiters_wake_in_order_and_the_queue_is_bounded() -> None:
    async def scenario() -> None:
        ledger = Ledger(AdmissionConfig(max_requests_per_node=1, max_queued=2, retry_after_s=3))
        lease = ledger.book(D, None, 1)
        deadline = time.time() + 30
        order: list[int] = []

        async def wait(i: int) -> None:
            await ledger.wait_for_room(deadline)
            order.append(i)

        first = asyncio.create_task(wait(1))
        second = asyncio.create_task(wait(2))
        await asyncio.sleep(0)
        assert ledger.queued == 2
        with pytest.raises(QueueFull) as refused:
            await ledger.wait_for_room(deadline)
        error = to_openai(refused.value)
        assert error.status == 429 and error.headers == {"Retry-After": "3"}
        lease.release()
        await first
        assert order == [1] and not second.done()
        ledger.book(D, None, 1).release()
        await second
        assert order == [1, 2] and ledger.queued == 0

    asyncio.run(scenario())


def test_a_waiter_gives_up_at_its_deadline() -> None:
    async def scenario() -> None:
        ledger = Ledger(AdmissionConfig(max_requests_per_node=1))
        ledger.book(D, None, 1)
        with pytest.raises(NoRoom) as late:
            await ledger.wait_for_room(time.time() + 0.05)
        assert to_openai(late.value).status == 503 and ledger.queued == 0

    asyncio.run(scenario())


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError):
        AdmissionConfig(max_requests_per_node=-1)
    with pytest.raises(ValueError):
        AdmissionConfig(retry_after_s=0)
