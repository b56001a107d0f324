"""The decode node (and `single`, the same node computing every prompt itself).

Owns the receiving end of the KV transfer, through the engine's remote-KV port only. D answers P's OPEN once
the router's request for it has arrived and the pool has room: OPENs wait, first come first served, in one
admission queue until `reserve_remote` succeeds with headroom (no local request starved of blocks, one
free block left per live request, fewer than --max-num-seqs requests live), so a full pool or a full batch
delays a transfer instead of refusing it, and P computes nothing until D can take it. DATA is scattered
straight into the reserved blocks; on COMPLETE the request enters continuous batching with the first token
P sampled (and ends there at once if that token ends it).

A transfer that fails (aborted, cut, corrupted, or its prefill node silent past the transfer connection's
liveness window) falls back to compute under `kv_load_failure_policy` "recompute" (vLLM's name; the
default): the reservation is given back and D prefills the prompt itself, within the request's deadline, on
the stream the router already reads; under "fail" the request ends with an error. Requests that name a
prefill node D saw go silent are computed here at once, until that node opens a transfer again.

Invariants: a reservation (a `KVReservation`, node/reservation.py) is ended exactly once (taken by
admission, or released on abort, cut, deadline, client gone); the request's deadline is its only clock, owned
by the `/internal/generate` stream (`_lines`) and by the OPEN's wait; a request that ended is tombstoned until
its deadline, so a late OPEN for it is refused instead of reserving blocks nobody will use; every
`/internal/generate` stream ends with exactly one line carrying finish_reason; a stream whose client goes away
aborts its request, including one still waiting for its KV.

Why one module of about 400 lines: the reservation-ends-once and one-deadline invariants span the OPEN's
admission, the generate stream and the recompute / local-fetch fallbacks; split apart, each piece would
restate the tombstones and the deadline it must share.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pdserve.kvtransfer.connector import Open, OpenRefused, OpenReply, TransferHandler
from pdserve.node.kv_fetch import PrefixFetcher
from pdserve.node.node_metrics import RequestTiming
from pdserve.node.node_runtime import NodeRuntime
from pdserve.node.reservation import KVReservation, Reservations
from pdserve.shared.engine.request import Request as EngineRequest
from pdserve.shared.node.node_protocol import NodeGenerateRequest, StepOutput
from pdserve.shared.tracing import Attributes, wall_ns
from pdserve.shared.types import FirstToken, KVSource, NodeId, RequestId

log = logging.getLogger(__name__)

ADMISSION_POLL_S = 0.02
"""How often the head of the admission queue retries its reservation while the pool is full."""


@dataclass
class _Pending:
    """A request whose KV comes from a prefill node, from the first of the router's call and P's OPEN
    until it is admitted to the engine or ends."""

    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    request: NodeGenerateRequest | None = None
    # built with its prompt's block hashes when the request arrives, off the path from COMPLETE to the
    # first token (hashing a 4k-token prompt costs about half a millisecond)
    engine_request: EngineRequest | None = None
    queue: asyncio.Queue[StepOutput] | None = None
    reservation: KVReservation = field(default_factory=KVReservation)
    ended: str | None = None


KVLoadFailurePolicy = Literal["recompute", "fail"]


class DecodeHandler(TransferHandler):
    def __init__(self, rt: NodeRuntime, kv_load_failure_policy: KVLoadFailurePolicy = "recompute") -> None:
        self.rt = rt
        self.recompute = kv_load_failure_policy == "recompute"
        self._silent: set[NodeId] = set()  # prefill nodes whose transfer connection went silent
        self.pending: dict[RequestId, _Pending] = {}
        rt.requests_outside_engine = lambda: len(self.pending)
        self._admission = asyncio.Lock()  # FIFO: asyncio wakes a lock's waiters in arrival order
        self._ended: dict[RequestId, float] = {}  # tombstones: request id -> when to forget it
        self._ended_order: deque[RequestId] = deque()
        self._background: set[asyncio.Future[Any]] = set()
        self.reservations = Reservations(rt)

    def _entry(self, rid: RequestId) -> _Pending:
        entry = self.pending.get(rid)
        if entry is None:
            entry = self.pending[rid] = _Pending()
        return entry

    def arrive(self, gen: NodeGenerateRequest, req: EngineRequest, q: asyncio.Queue[StepOutput]) -> None:
        """The router's request for a remotely prefilled prompt; its outputs go to `q`."""
        rid = RequestId(gen.request_id)
        if rid in self._ended:
            q.put_nowait(StepOutput.failed(rid, len(gen.prompt_token_ids)))
            log.warning("request %s arrived after its KV transfer had ended", rid)
            return
        entry = self._entry(rid)
        entry.request, entry.engine_request, entry.queue = gen, req, q
        entry.arrived.set()
        if gen.prefill_node_id in self._silent:
            self._spawn(self.kv_lost(rid, f"prefill node {gen.prefill_node_id} went silent"))

    async def on_open(self, peer: NodeId, req: Open) -> OpenReply:
        self._silent.discard(peer)
        if req.transfer_id in self._ended:
            raise OpenRefused("the request already ended on the decode node")
        entry = self._entry(req.transfer_id)
        if entry.reservation.blocks is not None:
            raise OpenRefused("transfer already open")
        opened_at = time.monotonic()
        try:
            async with asyncio.timeout(max(0.0, req.deadline - time.time())):
                await entry.arrived.wait()  # the router's request, sent beside P's, may come second
                async with self._admission:
                    while entry.ended is None:
                        res = await self.reservations.reserve(req.block_hashes, req.num_blocks, headroom=True)
                        if res.blocks is not None:
                            entry.reservation = res
                            break
                        await asyncio.sleep(ADMISSION_POLL_S)
        except TimeoutError:
            await self.fail(req.transfer_id, "deadline passed while the decode node had no room for the KV")
        except asyncio.CancelledError:  # the transfer connection ended
            await asyncio.shield(
                self.kv_lost(req.transfer_id, "KV transfer connection ended before OPEN was answered")
            )
            raise
        blocks = entry.reservation.blocks
        if entry.ended is not None or blocks is None:
            await entry.reservation.release()  # reserved while the request ended (fail() found none yet)
            raise OpenRefused(entry.ended or "the request ended on the decode node")
        if self.rt.tracing.enabled and entry.request is not None:
            attrs: Attributes = {"pdserve.node": self.rt.node_id, "pdserve.held_blocks": len(blocks.held),
                     "pdserve.reserved_blocks": len(blocks.dst)}  # fmt: skip
            self.rt.tracing.record("decode.admission_wait", entry.request.trace_context, wall_ns(opened_at),
                                   wall_ns(time.monotonic()), attrs)  # fmt: skip
        return OpenReply(len(blocks.held), tuple(blocks.dst))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def on_data(
        self, transfer_id: RequestId, layer_start: int, dst_block_ids: torch.Tensor, buffer: torch.Tensor
    ) -> None:
        entry = self.pending.get(transfer_id)
        if entry is None or entry.ended or entry.reservation.blocks is None:
            raise RuntimeError(f"transfer {transfer_id} was aborted on the decode node")
        # The scatter is queued on the current stream, which the connector waits for before it reuses the
        # buffer; the reserved blocks are read by nobody else.
        self.rt.engine.import_layers(layer_start, dst_block_ids, buffer)
        self.rt.metrics.transfer_bytes.labels(self.rt.connector_kind, "in").inc(buffer.nbytes)

    async def on_complete(self, transfer_id: RequestId, first_token: FirstToken | None) -> None:
        entry = self.pending.get(transfer_id)
        res = None if entry is None or entry.ended else entry.reservation.blocks
        if entry is None or res is None:
            raise RuntimeError(f"transfer {transfer_id} completed after it was aborted")
        if first_token is None:
            raise RuntimeError(f"transfer {transfer_id} completed without the first token")
        req, q = entry.engine_request, entry.queue
        assert req is not None and q is not None, "OPEN is answered only once the request arrived"
        engine = self.rt.engine
        out = await self.rt.aengine.call(lambda: engine.admit_remote(req, res, first_token))
        entry.reservation.take()  # the engine holds its blocks now
        self.pending.pop(transfer_id, None)
        m = self.rt.metrics
        held_tokens = min(len(res.held) * engine.cfg.block_size, out.prompt_tokens)
        m.prefix_hit_tokens.labels(KVSource.LOCAL).inc(held_tokens)
        m.prefix_hit_tokens.labels(KVSource.TRANSFERRED).inc(out.prompt_tokens - held_tokens)
        q.put_nowait(out)
        if entry.ended is not None and not out.finished:  # the client left while it was being admitted
            await self.rt.aengine.abort(transfer_id)

    async def on_abort(self, transfer_id: RequestId, reason: str) -> None:
        await self.kv_lost(transfer_id, f"KV transfer aborted: {reason}")

    async def on_peer_silent(self, peer: NodeId, reason: str) -> None:
        self._silent.add(peer)
        for rid, entry in list(self.pending.items()):
            if entry.request is not None and entry.request.prefill_node_id == peer:
                await self.kv_lost(rid, f"prefill node {peer}: {reason}")

    async def kv_lost(self, rid: RequestId, reason: str) -> None:
        """The request's KV will not arrive whole. Under "recompute", while its deadline holds, the
        reservation goes back and the engine prefills the prompt here, its outputs going to the stream
        that waited for the transfer; otherwise (or before the router's request arrived) it fails."""
        entry = self.pending.get(rid)
        gen = entry.request if entry is not None else None
        req = entry.engine_request if entry is not None else None
        if not self.recompute or entry is None or entry.ended or gen is None or req is None:
            await self.fail(rid, reason)
            return
        if time.time() >= gen.deadline:
            await self.fail(rid, f"{reason}; the deadline passed")
            return
        del self.pending[rid]
        self._tombstone(rid, gen.deadline)  # P's later OPEN for it is refused
        entry.ended = f"computed on the decode node: {reason}"
        entry.arrived.set()  # an OPEN still waiting for room gives up
        engine = self.rt.engine
        await entry.reservation.release()
        log.warning("request %s: %s; computing its prompt on the decode node", rid, reason)
        self.rt.metrics.transfers.labels(self.rt.connector_kind, "recomputed").inc()
        try:
            await self.rt.aengine.call(lambda: engine.add_request(req))
        except Exception as exc:  # the engine died: the stream ends with the error
            log.error("request %s could not be computed here: %r", rid, exc)
            assert entry.queue is not None
            entry.queue.put_nowait(StepOutput.failed(rid, len(gen.prompt_token_ids)))

    def _tombstone(self, rid: RequestId, until: float) -> None:
        now = time.time()
        while self._ended_order and self._ended.get(self._ended_order[0], 0.0) < now:
            self._ended.pop(self._ended_order.popleft(), None)
        if rid not in self._ended:
            self._ended_order.append(rid)
        self._ended[rid] = max(until, now + 1.0)

    async def fail(self, rid: RequestId, reason: str) -> None:
        """Ends a request still waiting for its KV: gives back its reservation, ends its stream with an
        error, and refuses a later OPEN for it. A no-op (but for the tombstone) once it was admitted."""
        entry = self.pending.pop(rid, None)
        deadline = entry.request.deadline if entry is not None and entry.request is not None else 0.0
        self._tombstone(rid, deadline or time.time() + 60.0)
        if entry is None:
            return
        entry.ended = reason
        entry.arrived.set()  # wakes an OPEN waiting for the request
        await entry.reservation.release()
        if entry.queue is not None:
            n = len(entry.request.prompt_token_ids) if entry.request else 0
            entry.queue.put_nowait(StepOutput.failed(rid, n))
        log.warning("request %s failed on the decode node: %s", rid, reason)


def add_decode_routes(
    app: FastAPI, rt: NodeRuntime, handler: DecodeHandler, fetcher: PrefixFetcher | None = None
) -> None:
    @app.post("/internal/generate")
    async def generate(request: Request) -> Any:
        try:
            gen = NodeGenerateRequest.from_json(await request.body())
            if gen.sampling.constraint is None:
                rt.engine.validate(gen.prompt_token_ids, gen.sampling)
            else:  # compiles the grammar (cached): up to a second for a new one, off the event loop
                await asyncio.to_thread(rt.engine.validate, gen.prompt_token_ids, gen.sampling)
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        if (refused := rt.refuses("decode")) is not None:
            return JSONResponse({"error": refused}, status_code=503)
        rid = RequestId(gen.request_id)
        rt.metrics.prompt_tokens.inc(len(gen.prompt_token_ids))
        if gen.prefill_node_id is None:
            engine_req = rt.engine.new_request(rid, gen.prompt_token_ids, gen.sampling, gen.cache_salt)
            outputs: AsyncIterator[StepOutput] = (
                rt.aengine.generate(engine_req)
                if gen.fetch_from_url is None or fetcher is None
                else _fetched_local(rt, fetcher, gen, engine_req)
            )
        else:
            q = rt.aengine.open_stream(rid)
            engine_req = rt.engine.new_request(rid, gen.prompt_token_ids, gen.sampling, gen.cache_salt)
            rt.engine.prompt_hashes(engine_req)
            handler.arrive(gen, engine_req, q)
            outputs = _remote_stream(rt, handler, rid, q)
        return StreamingResponse(_lines(rt, gen, engine_req, outputs), media_type="application/x-ndjson")


async def _fetched_local(
    rt: NodeRuntime, fetcher: PrefixFetcher, gen: NodeGenerateRequest, req: EngineRequest
) -> AsyncIterator[StepOutput]:
    """A prompt computed here after fetching the prefix blocks a holder has beyond this node's own (the cost
    model's `local_fetch`): the fetch lands in reserved blocks, committed as cached, which the request's
    admission then matches like its own; the reservation is given back once the prefill ended (its first
    output) or the stream ended. A short or failed fetch only leaves more to compute."""
    hashes = rt.engine.prompt_hashes(req)
    n = len(gen.prompt_token_ids)
    rid = RequestId(gen.request_id)
    fetched = await fetcher.fetch_for(rid, n, hashes, gen.fetch_from_url, gen.fetch_blocks, gen.deadline)
    try:
        async for out in rt.aengine.generate(req):
            if fetched is not None:
                done, fetched = fetched, None
                await fetcher.release(done)
            yield out
    finally:
        if fetched is not None:
            await fetcher.release(fetched)


async def _remote_stream(
    rt: NodeRuntime, handler: DecodeHandler, rid: RequestId, q: asyncio.Queue[StepOutput]
) -> AsyncIterator[StepOutput]:
    try:
        async for out in rt.aengine.stream(rid, q):
            yield out
    finally:
        await handler.fail(rid, "client went away")


def _trace_decode(
    rt: NodeRuntime, gen: NodeGenerateRequest, req: EngineRequest, out: StepOutput, t0: float,
    first_at: float | None, end: float,
) -> None:  # fmt: skip
    """The request's spans on this node, under the router's request span: its whole stay (tokens,
    preemptions), and its first token (for a remotely prefilled prompt: the wait for the KV, then the
    admission of P's token)."""
    tracing = rt.tracing
    span = tracing.record("decode", gen.trace_context, wall_ns(t0), wall_ns(end), {
        "pdserve.node": rt.node_id, "pdserve.request_id": gen.request_id,
        "pdserve.prompt_tokens": out.prompt_tokens, "pdserve.cached_tokens": out.cached_tokens,
        "pdserve.completion_tokens": out.completion_tokens, "pdserve.preemptions": req.num_preemptions,
        "pdserve.finish_reason": out.finish_reason or "", "pdserve.prefill_node": gen.prefill_node_id or "",
    })  # fmt: skip
    if first_at is not None:
        tracing.record("decode.first_token", span, wall_ns(t0), wall_ns(first_at), {})


async def _lines(
    rt: NodeRuntime, gen: NodeGenerateRequest, req: EngineRequest, outputs: AsyncIterator[StepOutput]
) -> AsyncIterator[bytes]:
    t0 = time.monotonic()
    last = t0
    first_at: float | None = None
    first = True
    m = rt.metrics
    try:
        while True:
            try:
                # The request's one deadline: past it the node aborts (freeing its blocks) and says so.
                async with asyncio.timeout(max(0.0, gen.deadline - time.time())):
                    out = await anext(outputs)
            except StopAsyncIteration:
                return
            except TimeoutError:
                yield StepOutput.failed(
                    gen.request_id, len(gen.prompt_token_ids), "deadline exceeded"
                ).to_line()
                return
            now = time.monotonic()
            if out.token_ids:
                if first and gen.prefill_node_id is None:
                    m.prefix_hit_tokens.labels(KVSource.LOCAL).inc(out.cached_tokens)
                    m.prefix_hit_tokens.labels(KVSource.MISS).inc(out.prompt_tokens - out.cached_tokens)
                if first:
                    m.first_token(now - t0)
                    first_at = now
                else:
                    m.inter_token(now - last, len(out.token_ids))
                first, last = False, now
                m.generation_tokens.inc(len(out.token_ids))
            yield out.to_line()
            if out.finished:
                if rt.tracing.enabled:
                    _trace_decode(rt, gen, req, out, t0, first_at, now)
                # A remotely prefilled request's queue and prefill time are the prefill node's to report.
                scheduled = out.scheduled_time if gen.prefill_node_id is None else None
                m.request_done(
                    RequestTiming(
                        t0,
                        scheduled,
                        first_at,
                        now,
                        out.prompt_tokens,
                        out.completion_tokens,
                        out.finish_reason or "error",
                    )
                )
                return
    finally:
        with contextlib.suppress(Exception):
            await outputs.aclose()  # type: ignore[attr-defined]
