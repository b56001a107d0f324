"""The prefill node: computes a prompt's KV, samples the first token, and streams the KV into the decode
node's reserved blocks while the forward pass runs, a frame per `layers_per_frame` consecutive layers.

Invariants: the OPEN to D goes out before the request enters P's engine, and P computes only once D has
reserved (D answers OPEN when it has room: its admission queue), so a request waiting for D's KV holds no
blocks on P and P never computes KV that has nowhere to go; D's reply says how many leading blocks it holds,
and P sends every block after those, whether P computed it in this request or served it from its own prefix
cache (`_Job.next_block`: each step exports from the first block not yet sent); each layer's blocks are
copied out of the paged cache on the engine thread right after the layer writes them, into a private
buffer on the cache's device (so later steps may reuse or evict P's blocks freely, and the connector decides
whether to stage it through host memory); a transfer ends exactly once (COMPLETE+ACK or ABORT), on every
path. When the router names a holder of prefix blocks P lacks (`fetch_from_url`), P fetches them after D's
OPEN reply and before its engine sees the request (node/kv_fetch.py), so the request's admission
matches them like its own cache; the fetch's blocks stay referenced until the prefill ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pdserve.kvtransfer.connector import (
    FrameBlocks,
    KVSender,
    KVTransferError,
    OpenReply,
    TransferSession,
    TransferStats,
)
from pdserve.kvtransfer.device_sync import event_done
from pdserve.node.kv_fetch import FetchedPrefix, PrefixFetcher
from pdserve.node.node_routes import message_response
from pdserve.node.node_runtime import NodeRuntime
from pdserve.shared.engine.engine import StepObserver, StepSlice
from pdserve.shared.node.node_protocol import PrefillRequest, PrefillResult, StepOutput
from pdserve.shared.tracing import gib_per_s, wall_ns
from pdserve.shared.types import BlockHash, BlockId, FirstToken, KVSource, RequestId

log = logging.getLogger(__name__)


@dataclass
class _Job:
    req: PrefillRequest
    session: TransferSession
    reply: OpenReply
    next_block: int
    """The first prompt block not yet exported: D's held prefix at first, then each step's end (a chunk
    ending inside a block exports that block again with the next chunk, once it is whole)."""
    # (first layer, first block index, P's block ids, buf [n_layers, 2, n, B, Hkv, D], event the last
    # gather recorded on a CUDA stream): one DATA frame each; None ends the stream
    chunks: asyncio.Queue[tuple[int, int, list[BlockId], torch.Tensor, torch.cuda.Event | None] | None] = (
        field(default_factory=asyncio.Queue)
    )
    # the frame being filled on the engine thread: (first block index, block ids, ids on the device, buf)
    filling: tuple[int, list[BlockId], torch.Tensor, torch.Tensor] | None = None
    sender_task: asyncio.Task[int] | None = None
    # set once the first token is on the host: the GPU has passed every gather queued before it, so the
    # sender looks at its event again at once instead of at the end of a (millisecond-grained) sleep
    computed: asyncio.Event = field(default_factory=asyncio.Event)


class PrefillObserver(StepObserver):
    """Runs on the engine thread; hands gathered layer buffers to the asyncio loop."""

    def __init__(self, rt: NodeRuntime, loop: asyncio.AbstractEventLoop, layers_per_frame: int) -> None:
        self.rt = rt
        self.loop = loop
        self.jobs: dict[RequestId, _Job] = {}
        self.layers_per_frame = layers_per_frame

    def on_layer(self, layer: int, scheduled: Sequence[StepSlice]) -> None:
        engine = self.rt.engine
        bs, num_layers = engine.cfg.block_size, engine.num_layers
        for s in scheduled:
            job = self.jobs.get(s.request_id)
            if job is None:
                continue
            end = min(s.start + s.num_new_tokens, s.num_prompt_tokens)
            b0, b1 = job.next_block, -(-end // bs)
            if layer == num_layers - 1:  # the step's last layer: later steps export from here
                job.next_block = b1 if end == s.num_prompt_tokens else max(b0, end // bs)
            if b1 <= b0:
                continue
            # this step's layers go out in frames of `layers_per_frame` consecutive layers
            first = layer - layer % self.layers_per_frame
            n_layers = min(self.layers_per_frame, num_layers - first)
            if layer == first:
                ids = list(s.blocks[b0:b1])
                # buf: [n_layers, 2, n, B, Hkv, D], a private copy: P's blocks may be reused after this step
                buf = engine.export_buffer(n_layers, len(ids))
                # ids from pinned memory without a sync: a pageable copy would stall the host until the GPU
                # caught up, holding the GIL, so the transfer's asyncio thread could not send meanwhile
                ids_dev = torch.tensor(ids, dtype=torch.int64, pin_memory=buf.is_cuda).to(
                    buf.device, non_blocking=True
                )
                job.filling = (b0, ids, ids_dev, buf)
            assert job.filling is not None and job.filling[0] == b0, "a frame's layers come from one step"
            _, ids, ids_dev, buf = job.filling
            engine.export_layer(layer, ids_dev, buf[layer - first])
            if layer < first + n_layers - 1:
                continue
            job.filling = None
            # buf stays where the cache is: the connector stages it through host memory if its link
            # needs that. The event lets the sender wait (without blocking the loop) for the gathers only.
            event = None
            if buf.is_cuda:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(buf.device))
            self.loop.call_soon_threadsafe(job.chunks.put_nowait, (first, b0, ids, buf, event))


@dataclass
class _Marks:
    """time.monotonic() readings of one prefill, for its spans: start, D's OPEN reply, entry to the engine."""

    started: float
    opened: float = 0.0
    entered: float = 0.0

    def trace(
        self,
        rt: NodeRuntime,
        req: PrefillRequest,
        last: StepOutput,
        fetched: FetchedPrefix | None,
        sent: int,
        stats: TransferStats,
        prefilled_at: float,
        acked_at: float,
    ) -> None:
        """The prefill's spans under the router's request span: the prefill, D's admission of its KV (OPEN
        until D reserved), the prefix fetch, the engine queue, the compute, and the transfer to D."""
        tracing, n = rt.tracing, len(req.prompt_token_ids)
        scheduled = last.scheduled_time or self.entered
        span = tracing.record("prefill", req.trace_context, wall_ns(self.started), wall_ns(acked_at), {
            "pdserve.node": rt.node_id, "pdserve.request_id": req.request_id, "pdserve.prompt_tokens": n,
            "pdserve.cached_tokens": last.cached_tokens, "pdserve.computed_tokens": n - last.cached_tokens,
        })  # fmt: skip
        tracing.record("prefill.decode_admission", span, wall_ns(self.started), wall_ns(self.opened),
                       {"pdserve.decode_node": req.decode_node_id})  # fmt: skip
        if fetched is not None:
            tracing.record("prefill.fetch", span, wall_ns(self.opened), wall_ns(self.entered), {
                "pdserve.fetch.asked_blocks": fetched.asked_blocks, "pdserve.fetch.landed": fetched.landed,
            })  # fmt: skip
        tracing.record("prefill.queue", span, wall_ns(self.entered), wall_ns(scheduled), {})
        tracing.record("prefill.compute", span, wall_ns(scheduled), wall_ns(prefilled_at),
                       {"pdserve.cached_tokens": last.cached_tokens})  # fmt: skip
        tracing.record("kv_transfer", span, wall_ns(acked_at - stats.seconds), wall_ns(acked_at), {
            "pdserve.transfer.bytes": stats.payload_bytes, "pdserve.transfer.blocks": sent,
            "pdserve.transfer.connector": rt.connector_kind,
            "pdserve.transfer.gib_per_s": gib_per_s(stats.payload_bytes, stats.seconds),
            "pdserve.decode_node": req.decode_node_id,
        })  # fmt: skip


class PrefillService:
    def __init__(
        self,
        rt: NodeRuntime,
        sender: Callable[[], KVSender],
        layers_per_frame: int = 4,
        fetcher: PrefixFetcher | None = None,
    ) -> None:
        if layers_per_frame < 1:
            raise ValueError(f"layers_per_frame must be >= 1, got {layers_per_frame}")
        self.rt = rt
        self.sender = sender
        self.fetcher = fetcher
        self.layers_per_frame = layers_per_frame
        self.observer: PrefillObserver | None = None
        self._opening = 0  # requests waiting for D's OPEN reply, not yet in the engine
        self.in_flight = 0
        """Prefill requests this node is serving, from the route's call to its reply (a role change waits
        for none to be left: node/role_change.py)."""
        rt.requests_outside_engine = lambda: self._opening

    def attach(self) -> None:
        self.observer = PrefillObserver(self.rt, asyncio.get_running_loop(), self.layers_per_frame)
        self.rt.engine.observer = self.observer

    async def _send(self, job: _Job) -> int:
        """Streams the gathered layers until the observer's stream ends; returns blocks sent. Leaves the
        session for `prefill()` to complete or abort."""
        sent: set[int] = set()
        while True:
            item = await job.chunks.get()
            if item is None:
                return len(sent)
            layer, b0, src_ids, buf, event = item
            if event is not None:
                await event_done(event, job.computed)
            blocks = FrameBlocks.run(job.reply, b0, src_ids)
            await job.session.send_layers(layer, blocks, buf)
            sent.update(blocks.indices)

    async def _fetch(self, req: PrefillRequest, hashes: Sequence[BlockHash]) -> FetchedPrefix | None:
        """Fetches the prefix blocks the router said another node holds and this one lacks."""
        if self.fetcher is None:
            return None
        n = len(req.prompt_token_ids)
        return await self.fetcher.fetch_for(
            req.request_id, n, hashes, req.fetch_from_url, req.fetch_blocks, req.deadline
        )

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        engine = self.rt.engine
        assert self.observer is not None
        rid = RequestId(req.request_id)
        params = req.sampling
        first_params = type(params).from_dict(
            {**params.to_dict(), "max_tokens": 1, "ignore_eos": True, "stop": []}
        )
        engine_req = engine.new_request(rid, req.prompt_token_ids, first_params, req.cache_salt)
        hashes = engine.prompt_hashes(engine_req)
        num_blocks = -(-len(req.prompt_token_ids) // engine.cfg.block_size)
        t0 = time.perf_counter()
        marks = _Marks(time.monotonic())
        last: StepOutput | None = None
        job: _Job | None = None
        session: TransferSession | None = None
        fetched: FetchedPrefix | None = None
        opened = False  # D took the transfer: from then on its failure is D's to handle
        fetch_s = 0.0
        try:
            async with asyncio.timeout(max(0.0, req.deadline - time.time())):
                session = await self.sender().session(req.decode_transfer_addr, rid)
                # waits while D has no room (its admission queue); P holds nothing for the request meanwhile
                self._opening += 1
                try:
                    reply: OpenReply = await session.open(hashes, num_blocks, req.deadline)
                finally:
                    self._opening -= 1
                opened = True
                marks.opened = time.monotonic()
                fetch_t0 = time.perf_counter()
                fetched = await self._fetch(req, hashes)
                fetch_s = time.perf_counter() - fetch_t0 if fetched is not None else 0.0
                marks.entered = time.monotonic()
                job = _Job(req, session, reply, reply.num_held_blocks)
                job.sender_task = asyncio.ensure_future(self._send(job))
                self.observer.jobs[rid] = job
                async for out in self.rt.aengine.generate(engine_req):
                    last = out
            prefilled_at = time.monotonic()
            assert last is not None and job is not None and session is not None
            if last.finish_reason not in ("length", "stop") or not last.token_ids:
                raise RuntimeError(f"prefill ended with {last.finish_reason}")
            self.observer.jobs.pop(rid, None)
            job.computed.set()
            job.chunks.put_nowait(None)
            sent = await job.sender_task
            lp = last.logprobs[0] if last.logprobs else None
            token = last.token_ids[0]
            stats = await session.complete(
                FirstToken(token)
                if lp is None
                else FirstToken(token, lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top))
            )
            acked_at = time.monotonic()
            m = self.rt.metrics
            m.transfer_bytes.labels(self.rt.connector_kind, "out").inc(stats.payload_bytes)
            m.transfer_seconds.labels(self.rt.connector_kind).observe(stats.seconds)
            m.transfers.labels(self.rt.connector_kind, "ok").inc()
            m.prompt_tokens.inc(len(req.prompt_token_ids))
            scheduled = last.scheduled_time or last.arrival_time
            m.prefill_done(last.arrival_time, scheduled, prefilled_at, len(req.prompt_token_ids))
            bs = engine.cfg.block_size
            remote = 0 if fetched is None else min(fetched.landed * bs, last.cached_tokens)
            m.prefix_hit_tokens.labels(KVSource.LOCAL).inc(last.cached_tokens - remote)
            m.prefix_hit_tokens.labels(KVSource.REMOTE).inc(remote)
            m.prefix_hit_tokens.labels(KVSource.MISS).inc(len(req.prompt_token_ids) - last.cached_tokens)
            log.info(
                "prefill %s: %d tokens, %d cached here (%d fetched), %d held on D, %d blocks sent in %.3fs",
                rid,
                len(req.prompt_token_ids),
                last.cached_tokens,
                remote,
                reply.num_held_blocks,
                sent,
                time.perf_counter() - t0,
            )
            if self.rt.tracing.enabled:
                marks.trace(self.rt, req, last, fetched, sent, stats, prefilled_at, acked_at)
            return PrefillResult(
                rid,
                last.token_ids[0],
                len(req.prompt_token_ids) - last.cached_tokens,
                last.cached_tokens,
                sent,
                fetched_tokens=remote,
                fetch_seconds=fetch_s,
                compute_seconds=max(0.0, prefilled_at - scheduled),
                transfer_seconds=stats.seconds,
                transfer_tail_seconds=max(0.0, acked_at - prefilled_at),
            )
        except (KVTransferError, RuntimeError, TimeoutError, ValueError) as exc:
            self.rt.metrics.transfers.labels(self.rt.connector_kind, "failed").inc()
            await self._abort(rid, job, session, str(exc) or type(exc).__name__)
            # D took the transfer: it computes the prompt itself (or fails it, by its policy)
            return PrefillResult(rid, None, 0, 0, 0, f"prefill failed: {exc}", decode_computes=opened)
        except BaseException:
            await self._abort(rid, job, session, "prefill cancelled")
            raise
        finally:
            self.observer.jobs.pop(rid, None)
            if fetched is not None and self.fetcher is not None:
                await self.fetcher.release(fetched)

    async def _abort(
        self, rid: RequestId, job: _Job | None, session: TransferSession | None, reason: str
    ) -> None:
        await self.rt.aengine.abort(rid)
        if job is not None and job.sender_task is not None:
            job.sender_task.cancel()
            with contextlib.suppress(BaseException):
                await job.sender_task
        if session is not None:
            with contextlib.suppress(KVTransferError):
                await session.abort(reason)


def add_prefill_routes(app: FastAPI, service: PrefillService) -> None:
    @app.post("/internal/prefill")
    async def prefill(request: Request) -> Response:
        try:
            req = PrefillRequest.from_json(await request.body())
            if req.sampling.constraint is None:
                service.rt.engine.validate(req.prompt_token_ids, req.sampling)
            else:  # compiles the grammar (cached): up to a second for a new one, off the event loop
                await asyncio.to_thread(service.rt.engine.validate, req.prompt_token_ids, req.sampling)
        except ValueError as exc:
            return message_response(PrefillResult(RequestId("invalid"), None, 0, 0, 0, error=str(exc)), 400)
        if (refused := service.rt.refuses("prefill")) is not None:
            return message_response(
                PrefillResult(RequestId(req.request_id), None, 0, 0, 0, error=refused), 503
            )
        service.in_flight += 1
        try:
            result = await service.prefill(req)
        finally:
            service.in_flight -= 1
        return message_response(result, 200 if result.error is None else 502)
