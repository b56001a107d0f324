"""The prefill node: computes a prompt's KV, samples the first token, and streams the KV into the decode
node's reserved blocks while the forward pass runs, a frame per `layers_per_frame` consecutive layers.

Invariants: the OPEN to D (its just-in-time reservation) goes out when the engine first computes the
request, not when it is queued; each layer's blocks are copied out of the paged cache on the engine
thread right after the layer writes them, into a private buffer on the cache's device (so later steps may
reuse or evict P's blocks freely, and the connector decides whether to stage it through host memory); blocks D
already holds are never sent; a transfer ends exactly once (COMPLETE+ACK or ABORT), on every path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pdserve.kvtransfer.connector import (
    FrameBlocks,
    KVSender,
    KVTransferError,
    OpenReply,
    TransferSession,
)
from pdserve.kvtransfer.device_sync import event_done, stream_idle
from pdserve.shared.engine import RequestOutput, StepObserver
from pdserve.shared.node_protocol import PrefillRequest, PrefillResult
from pdserve.shared.node_runtime import NodeRuntime
from pdserve.shared.scheduler import ScheduledRequest
from pdserve.shared.types import BlockHash, BlockId, RequestId

log = logging.getLogger(__name__)


@dataclass
class _Job:
    req: PrefillRequest
    hashes: tuple[BlockHash, ...]
    num_blocks: int
    # (first layer, first block index, P's block ids, buf [n_layers, 2, n, B, Hkv, D], event the last
    # gather recorded on a CUDA stream): one DATA frame each
    chunks: asyncio.Queue[tuple[int, int, list[BlockId], torch.Tensor, torch.cuda.Event | None] | None] = (
        field(default_factory=asyncio.Queue)
    )
    # the frame being filled on the engine thread: (first block index, block ids, ids on the device, buf)
    filling: tuple[int, list[BlockId], torch.Tensor, torch.Tensor] | None = None
    opened: bool = False
    sender_task: asyncio.Task[int] | None = None
    session: TransferSession | None = None


class PrefillObserver(StepObserver):
    """Runs on the engine thread; hands gathered layer buffers to the asyncio loop."""

    def __init__(
        self, rt: NodeRuntime, loop: asyncio.AbstractEventLoop, start_sender: Any, layers_per_frame: int
    ) -> None:
        self.rt = rt
        self.loop = loop
        self.jobs: dict[RequestId, _Job] = {}
        self.start_sender = start_sender
        self.layers_per_frame = layers_per_frame

    def on_layer(self, layer: int, scheduled: Sequence[ScheduledRequest]) -> None:
        runner = self.rt.engine.runner
        bs = runner.block_size
        for s in scheduled:
            job = self.jobs.get(s.request.request_id)
            if job is None:
                continue
            if not job.opened:
                job.opened = True
                self.loop.call_soon_threadsafe(self.start_sender, job)
            end = min(s.start + s.num_new_tokens, s.request.num_prompt_tokens)
            b0, b1 = s.start // bs, -(-end // bs)
            if b1 <= b0:
                continue
            # this step's layers go out in frames of `layers_per_frame` consecutive layers
            first = layer - layer % self.layers_per_frame
            n_layers = min(self.layers_per_frame, runner.kv_cache.shape[0] - first)
            if layer == first:
                ids = list(s.request.block_ids[b0:b1])
                # buf: [n_layers, 2, n, B, Hkv, D], a private copy: P's blocks may be reused after this step
                buf = torch.empty(
                    (n_layers, 2, len(ids), *runner.kv_cache.shape[3:]),
                    dtype=runner.kv_cache.dtype,
                    device=runner.device,
                )
                # ids from pinned memory without a sync: a pageable copy would stall the host until the GPU
                # caught up, holding the GIL, so the transfer's asyncio thread could not send meanwhile
                ids_dev = torch.tensor(ids, dtype=torch.int64, pin_memory=buf.is_cuda).to(
                    runner.device, non_blocking=True
                )
                job.filling = (b0, ids, ids_dev, buf)
            assert job.filling is not None and job.filling[0] == b0, "a frame's layers come from one step"
            _, ids, ids_dev, buf = job.filling
            runner.ops.gather_blocks(runner.kv_cache[layer], ids_dev, buf[layer - first])
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

    def on_step_done(self, scheduled: Sequence[ScheduledRequest]) -> None:
        return None


class PrefillService:
    def __init__(self, rt: NodeRuntime, sender: KVSender, layers_per_frame: int = 4) -> None:
        if layers_per_frame < 1:
            raise ValueError(f"layers_per_frame must be >= 1, got {layers_per_frame}")
        self.rt = rt
        self.sender = sender
        self.layers_per_frame = layers_per_frame
        self.observer: PrefillObserver | None = None

    def attach(self) -> None:
        self.observer = PrefillObserver(
            self.rt, asyncio.get_running_loop(), self._start_sender, self.layers_per_frame
        )
        self.rt.engine.observer = self.observer

    def _start_sender(self, job: _Job) -> None:
        job.sender_task = asyncio.ensure_future(self._send(job))

    async def _send(self, job: _Job) -> int:
        """Opens the transfer and streams the gathered layers; returns blocks sent. Leaves the session
        for `prefill()` to complete or abort."""
        session = await self.sender.session(job.req.decode_transfer_addr, RequestId(job.req.request_id))
        job.session = session
        reply: OpenReply = await session.open(job.hashes, job.num_blocks, job.req.deadline)
        sent: set[int] = set()
        while True:
            item = await job.chunks.get()
            if item is None:
                return len(sent)
            layer, b0, src_ids, buf, event = item
            if event is not None:
                await event_done(event)
            skip = max(0, reply.num_held_blocks - b0)  # the frame's leading blocks that D already holds
            if skip >= len(src_ids):
                continue
            blocks = FrameBlocks.run(reply, b0 + skip, src_ids[skip:])
            payload = buf
            if skip:  # buf: [n_layers, 2, n, B, Hkv, D]; the blocks are dim 2
                payload = buf[:, :, skip:].contiguous()
                if payload.is_cuda:  # the copy is queued behind the engine's work: wait for it once
                    await stream_idle(torch.cuda.current_stream(payload.device))
            await session.send_layers(layer, blocks, payload)
            sent.update(blocks.indices)

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        engine = self.rt.engine
        assert self.observer is not None
        rid = RequestId(req.request_id)
        params = req.sampling
        first_params = type(params).from_dict(
            {**params.to_dict(), "max_tokens": 1, "ignore_eos": True, "stop": []}
        )
        engine_req = engine.new_request(rid, req.prompt_token_ids, first_params, req.cache_salt)
        bs = engine.cfg.block_size
        engine_req.extend_block_hashes(bs)
        job = _Job(req, tuple(engine_req.block_hashes), -(-len(req.prompt_token_ids) // bs))
        self.observer.jobs[rid] = job
        t0 = time.perf_counter()
        last: RequestOutput | None = None
        try:
            async with asyncio.timeout(max(0.0, req.deadline - time.time())):
                async for out in self.rt.aengine.generate(engine_req):
                    last = out
            prefilled_at = time.monotonic()
            assert last is not None
            if last.finish_reason not in ("length", "stop") or not last.token_ids:
                raise RuntimeError(f"prefill ended with {last.finish_reason}")
            assert job.sender_task is not None, "the engine computed the request without opening its transfer"
            job.chunks.put_nowait(None)
            sent = await job.sender_task
            session = job.session
            assert session is not None
            lp = last.logprobs[0] if last.logprobs else None
            first: dict[str, Any] = {"token_id": last.token_ids[0]}
            if lp is not None:
                first |= {"logprob": lp.logprob, "top": [list(t) for t in lp.top]}
            stats = await session.complete(first)
            m = self.rt.metrics
            m.transfer_bytes.labels(self.rt.connector_kind, "out").inc(stats.payload_bytes)
            m.transfer_seconds.labels(self.rt.connector_kind).observe(stats.seconds)
            m.transfers.labels(self.rt.connector_kind, "ok").inc()
            m.prompt_tokens.inc(len(req.prompt_token_ids))
            scheduled = engine_req.scheduled_time or engine_req.arrival_time
            m.prefill_done(engine_req.arrival_time, scheduled, prefilled_at, len(req.prompt_token_ids))
            m.prefix_hit_tokens.labels("local").inc(last.cached_tokens)
            m.prefix_hit_tokens.labels("miss").inc(len(req.prompt_token_ids) - last.cached_tokens)
            log.info(
                "prefill %s: %d tokens, %d cached, %d blocks in %.3fs",
                rid,
                len(req.prompt_token_ids),
                last.cached_tokens,
                sent,
                time.perf_counter() - t0,
            )
            return PrefillResult(
                rid,
                last.token_ids[0],
                len(req.prompt_token_ids) - last.cached_tokens,
                last.cached_tokens,
                sent,
            )
        except (KVTransferError, RuntimeError, TimeoutError, ValueError) as exc:
            self.rt.metrics.transfers.labels(self.rt.connector_kind, "failed").inc()
            await self._abort(job, str(exc) or type(exc).__name__)
            return PrefillResult(rid, None, 0, 0, 0, error=f"prefill failed: {exc}")
        except BaseException:
            await self._abort(job, "prefill cancelled")
            raise
        finally:
            self.observer.jobs.pop(rid, None)

    async def _abort(self, job: _Job, reason: str) -> None:
        await self.rt.aengine.abort(RequestId(job.req.request_id))
        if job.sender_task is not None:
            job.sender_task.cancel()
            with contextlib.suppress(BaseException):
                await job.sender_task
        if job.session is not None:
            with contextlib.suppress(KVTransferError):
                await job.session.abort(reason)


def add_prefill_routes(app: FastAPI, service: PrefillService) -> None:
    @app.post("/internal/prefill")
    async def prefill(request: Request) -> Response:
        try:
            req = PrefillRequest.from_json(await request.body())
            service.rt.engine.validate(req.prompt_token_ids, req.sampling)
        except ValueError as exc:
            return Response(
                PrefillResult(RequestId("invalid"), None, 0, 0, 0, error=str(exc)).to_json(),
                status_code=400,
                media_type="application/json",
            )
        if service.rt.draining:
            return Response(
                PrefillResult(RequestId(req.request_id), None, 0, 0, 0, error="node is draining").to_json(),
                status_code=503,
                media_type="application/json",
            )
        result = await service.prefill(req)
        return Response(
            result.to_json(), status_code=200 if result.error is None else 502, media_type="application/json"
        )
