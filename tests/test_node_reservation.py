"""A reservation for KV coming into a node ends exactly once, on every path, on both of its users: the
decode node's OPEN (DecodeHandler) and a prefix fetch's OPEN (FetchReceiver). Each scenario cancels, fails
or aborts an OPEN at one point (waiting for the router's request, while the engine thread reserves, after
the reply, while the pool is full) over a real engine (SmolLM2, CPU) and ends with the pool's counts back
where they started: no block kept, none given back twice."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from pdserve.decode_node.server import DecodeHandler
from pdserve.kvtransfer.connector import Open, OpenRefused
from pdserve.node.kv_fetch import FetchReceiver, PrefixFetcher
from pdserve.node.node_runtime import NodeRuntime, NodeSettings
from pdserve.shared.engine.block_pool import PoolAudit
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import LLMEngine
from pdserve.shared.engine.sampling_params import SamplingParams
from pdserve.shared.model.loader import LoadedModel
from pdserve.shared.node.node_protocol import NodeGenerateRequest
from pdserve.shared.node.node_sign import ClusterKeys
from pdserve.shared.types import BlockHash, NodeId, RequestId

pytestmark = pytest.mark.slow
BLOCKS = 12
PROMPT = tuple(range(300, 345))  # 45 tokens: 3 blocks of 16, 2 of them full
P = NodeId("prefill-0")


@contextlib.asynccontextmanager
async def node(loaded: LoadedModel) -> AsyncIterator[NodeRuntime]:
    engine = LLMEngine(EngineConfig(model=loaded.source, num_kv_blocks=BLOCKS), loaded)
    rt = NodeRuntime(NodeSettings("decode-0", "decode"), engine, ClusterKeys("test-token"))
    rt.aengine.start()
    try:
        yield rt
    finally:
        await rt.aengine.stop()


async def audit(rt: NodeRuntime) -> PoolAudit:
    return await rt.aengine.call(rt.engine.audit)


async def back_to(rt: NodeRuntime, start: PoolAudit) -> PoolAudit:
    """The pool's audit once background releases ran (each is one engine call, posted within a loop turn)."""
    for _ in range(500):
        now = await audit(rt)
        if now == start:
            return now
        await asyncio.sleep(0.01)
    return now


async def engine_held(rt: NodeRuntime) -> tuple[threading.Event, asyncio.Future[Any]]:
    """Holds the engine thread until the returned event is set: calls posted meanwhile queue behind it."""
    gate = threading.Event()
    held = asyncio.ensure_future(rt.aengine.call(gate.wait))
    await asyncio.sleep(0)
    return gate, held


async def turns(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def hashes_of(rt: NodeRuntime, rid: str) -> tuple[BlockHash, ...]:
    return rt.engine.prompt_hashes(rt.engine.new_request(RequestId(rid), PROMPT, SamplingParams(), None))


def arrive(rt: NodeRuntime, handler: DecodeHandler, rid: str) -> asyncio.Queue[Any]:
    gen = NodeGenerateRequest(
        RequestId(rid), PROMPT, SamplingParams(max_tokens=4), None, time.time() + 60, prefill_node_id=P
    )
    req = rt.engine.new_request(RequestId(rid), PROMPT, gen.sampling, None)
    rt.engine.prompt_hashes(req)
    q = rt.aengine.open_stream(RequestId(rid))
    handler.arrive(gen, req, q)
    return q


def open_req(rt: NodeRuntime, rid: str) -> Open:
    return Open(RequestId(rid), hashes_of(rt, rid), 3, time.time() + 60)


async def cancelled(aw: Awaitable[Any]) -> None:
    with contextlib.suppress(asyncio.CancelledError, OpenRefused):
        await aw


Scenario = Callable[[NodeRuntime], Awaitable[None]]


async def d_open_cancelled_while_the_engine_reserves(rt: NodeRuntime) -> None:
    handler = DecodeHandler(rt, "fail")
    arrive(rt, handler, "d1")
    gate, held = await engine_held(rt)
    task = asyncio.ensure_future(handler.on_open(P, open_req(rt, "d1")))
    await turns()  # the OPEN's reservation is queued on the engine thread
    task.cancel()
    await cancelled(task)
    gate.set()
    await held


async def d_open_cancelled_before_the_request_arrived(rt: NodeRuntime) -> None:
    handler = DecodeHandler(rt, "fail")
    task = asyncio.ensure_future(handler.on_open(P, open_req(rt, "d2")))
    await turns()
    task.cancel()
    await cancelled(task)


async def d_open_answered_then_aborted_twice_and_failed(rt: NodeRuntime) -> None:
    handler = DecodeHandler(rt, "fail")
    arrive(rt, handler, "d3")
    reply = await handler.on_open(P, open_req(rt, "d3"))
    assert reply.num_blocks == 3
    await handler.on_abort(RequestId("d3"), "P gave up")
    await handler.on_abort(RequestId("d3"), "P gave up again")
    await handler.fail(RequestId("d3"), "client went away")


async def d_open_answered_then_recomputed_is_released_before_compute(rt: NodeRuntime) -> None:
    handler = DecodeHandler(rt, "fail")
    arrive(rt, handler, "d4")
    await handler.on_open(P, open_req(rt, "d4"))
    await handler.on_peer_silent(P, "no byte for 5 s")


async def d_open_failed_while_the_request_ended_during_the_reservation(rt: NodeRuntime) -> None:
    handler = DecodeHandler(rt, "fail")
    arrive(rt, handler, "d5")
    gate, held = await engine_held(rt)
    task = asyncio.ensure_future(handler.on_open(P, open_req(rt, "d5")))
    await turns()
    await handler.fail(RequestId("d5"), "client went away")  # finds no reservation yet: the engine is held
    gate.set()
    await held
    with pytest.raises(OpenRefused):
        await task


async def d_open_waiting_for_room_then_failed(rt: NodeRuntime) -> None:
    filler = await rt.aengine.call(lambda: rt.engine.reserve_remote([], BLOCKS - 1))
    assert filler is not None
    handler = DecodeHandler(rt, "fail")
    arrive(rt, handler, "d6")
    task = asyncio.ensure_future(handler.on_open(P, open_req(rt, "d6")))
    await asyncio.sleep(0.1)  # a few admission polls find no room
    await handler.fail(RequestId("d6"), "deadline")
    with pytest.raises(OpenRefused):
        await task
    await rt.aengine.call(lambda: rt.engine.release_remote(filler))


async def fetching(rt: NodeRuntime, rid: str) -> tuple[FetchReceiver, asyncio.Future[None], Open]:
    """A fetch waiting on `receiver` (see waiting_fetch), and the OPEN its holder would send."""
    receiver = FetchReceiver(rt)
    fetch = asyncio.ensure_future(waiting_fetch(rt, receiver, rid))
    await turns()
    return receiver, fetch, Open(RequestId(f"{rid}/fetch"), hashes_of(rt, rid)[:2], 2, time.time() + 60)


async def fetch_open_cancelled_while_the_engine_reserves(rt: NodeRuntime) -> None:
    receiver, fetch, req = await fetching(rt, "f1")
    gate, held = await engine_held(rt)
    task = asyncio.ensure_future(receiver.on_open(P, req))
    await turns()
    task.cancel()
    await cancelled(task)
    gate.set()
    await held
    fetch.cancel()
    await cancelled(fetch)


async def fetch_open_answered_then_aborted_twice(rt: NodeRuntime) -> None:
    receiver, fetch, req = await fetching(rt, "f2")
    await receiver.on_open(P, req)
    await receiver.on_abort(req.transfer_id, "holder gave up")
    await receiver.on_abort(req.transfer_id, "holder gave up again")
    fetch.cancel()
    await cancelled(fetch)


async def fetch_open_answered_then_the_fetcher_stopped_waiting(rt: NodeRuntime) -> None:
    receiver, fetch, req = await fetching(rt, "f3")
    await receiver.on_open(P, req)
    fetch.cancel()
    await cancelled(fetch)
    await receiver.on_abort(req.transfer_id, "the fetcher left")


async def waiting_fetch(rt: NodeRuntime, receiver: FetchReceiver, rid: str) -> None:
    """A fetch from a holder that never answers: it waits (its HTTP call to a port nobody serves is retried
    by nobody) until cancelled, its transfer id registered with `receiver`."""
    fetcher = PrefixFetcher(rt, receiver, "tcp://127.0.0.1:1", "token")
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)  # accepts, never answers
    port = server.sockets[0].getsockname()[1]
    try:
        await fetcher.fetch(
            RequestId(rid), f"http://127.0.0.1:{port}", hashes_of(rt, rid)[:2], 0, time.time() + 60
        )
    finally:
        server.close()
        await fetcher.close()


SCENARIOS: list[Scenario] = [
    d_open_cancelled_while_the_engine_reserves,
    d_open_cancelled_before_the_request_arrived,
    d_open_answered_then_aborted_twice_and_failed,
    d_open_answered_then_recomputed_is_released_before_compute,
    d_open_failed_while_the_request_ended_during_the_reservation,
    d_open_waiting_for_room_then_failed,
    fetch_open_cancelled_while_the_engine_reserves,
    fetch_open_answered_then_aborted_twice,
    fetch_open_answered_then_the_fetcher_stopped_waiting,
]


def test_every_cancelled_failed_or_aborted_open_gives_its_blocks_back_once(loaded: LoadedModel) -> None:
    async def main() -> None:
        async with node(loaded) as rt:
            start = await audit(rt)
            assert (start.in_use, start.reserved) == (0, 0)
            for scenario in SCENARIOS:
                await scenario(rt)
                assert await back_to(rt, start) == start, scenario.__name__

    asyncio.run(main())
