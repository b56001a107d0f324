"""The decode node (and `single`, the same node computing every prompt itself).

Owns the receiving end of the KV transfer: on OPEN it matches the prefix this node already holds and
reserves the rest just in time; DATA is scattered straight into the reserved blocks; on COMPLETE the
request enters continuous batching with the first token P sampled. Invariants: a reservation is released
exactly once (abort, timeout, cut, or handed to the scheduler on completion); every `/internal/generate`
stream ends with exactly one line carrying finish_reason; a stream whose client goes away aborts its
request, including one still waiting for its KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pdserve.kvtransfer.connector import OpenRefused, OpenReply, TransferHandler
from pdserve.shared.block_pool import NoFreeBlocks
from pdserve.shared.engine import RequestOutput, TokenLogprob
from pdserve.shared.node_metrics import RequestTiming
from pdserve.shared.node_protocol import NodeGenerateRequest, StepOutput
from pdserve.shared.node_protocol import TokenLogprob as WireLogprob
from pdserve.shared.node_protocol import TopLogprob as WireTop
from pdserve.shared.node_runtime import NodeRuntime
from pdserve.shared.request import Request as EngineRequest
from pdserve.shared.types import BlockHash, BlockId, NodeId, RequestId

log = logging.getLogger(__name__)


@dataclass
class _Reservation:
    held: list[BlockId]
    dst: list[BlockId]
    released: bool = False


@dataclass
class _Pending:
    """A request whose KV comes from a prefill node."""

    request: NodeGenerateRequest | None = None
    # built with its prompt's block hashes when the request arrives, off the path from COMPLETE to the
    # first token (hashing a 4k-token prompt costs about half a millisecond)
    engine_request: EngineRequest | None = None
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    reservation: _Reservation | None = None
    queue: asyncio.Queue[RequestOutput] | None = None
    aborted: str | None = None


class DecodeHandler(TransferHandler):
    def __init__(self, rt: NodeRuntime) -> None:
        self.rt = rt
        self.pending: dict[RequestId, _Pending] = {}

    def _entry(self, rid: RequestId) -> _Pending:
        entry = self.pending.get(rid)
        if entry is None:
            entry = self.pending[rid] = _Pending()
        return entry

    async def on_open(
        self,
        peer: NodeId,
        transfer_id: RequestId,
        block_hashes: tuple[BlockHash, ...],
        num_blocks: int,
        deadline: float,
    ) -> OpenReply:
        if time.time() > deadline:
            raise OpenRefused("deadline already passed")
        entry = self._entry(transfer_id)
        if entry.aborted or entry.reservation is not None:
            raise OpenRefused(entry.aborted or "transfer already open")
        pool = self.rt.engine.pool

        def reserve() -> _Reservation:
            # The last block is always sent: D needs at least the final token's KV from P, and a held
            # full prompt would leave no slot for the first decode step's context anyway.
            held = pool.match_prefix(block_hashes[: max(0, num_blocks - 1)])
            pool.acquire(held)
            try:
                dst = pool.reserve(num_blocks - len(held))
            except NoFreeBlocks:
                pool.release(held[::-1])
                raise
            return _Reservation(held, dst)

        try:
            entry.reservation = await self.rt.aengine.call(reserve)
        except NoFreeBlocks as exc:
            raise OpenRefused(f"no free KV blocks for {num_blocks} blocks") from exc
        asyncio.get_running_loop().call_at(
            asyncio.get_running_loop().time() + max(0.0, deadline - time.time()),
            lambda: asyncio.ensure_future(self.expire(transfer_id)),
        )
        return OpenReply(len(entry.reservation.held), tuple(entry.reservation.dst))

    async def on_data(
        self, transfer_id: RequestId, layer_start: int, dst_block_ids: torch.Tensor, buffer: torch.Tensor
    ) -> None:
        entry = self.pending.get(transfer_id)
        if entry is None or entry.aborted:
            raise RuntimeError(f"transfer {transfer_id} was aborted on the decode node")
        runner = self.rt.engine.runner
        layers = buffer if buffer.dim() == 6 else buffer.unsqueeze(0)
        # buffer: [n_layers, 2, n, B, Hkv, D], in host memory or already on the cache's device (a GPU
        # connector receives there; `.to` is then a no-op). The scatter is queued on the current stream,
        # which the connector waits for before it reuses the buffer. The reserved blocks are read by
        # nobody else.
        ids = dst_block_ids.to(runner.device)
        for i in range(layers.shape[0]):
            runner.ops.scatter_blocks(layers[i].to(runner.device), runner.kv_cache[layer_start + i], ids)
        self.rt.metrics.transfer_bytes.labels(self.rt.connector_kind, "in").inc(buffer.nbytes)

    async def on_complete(self, transfer_id: RequestId, first_token: dict[str, Any]) -> None:
        entry = self.pending.get(transfer_id)
        if entry is None or entry.reservation is None or entry.aborted:
            raise RuntimeError(f"transfer {transfer_id} completed after it was aborted")
        await asyncio.wait_for(entry.arrived.wait(), timeout=max(0.1, self._deadline(entry) - time.time()))
        req = entry.engine_request
        assert req is not None and entry.queue is not None
        res = entry.reservation
        engine = self.rt.engine
        lp = first_token.get("logprob")
        first_lp = None
        if lp is not None:
            first_lp = TokenLogprob(
                int(first_token["token_id"]),
                float(lp),
                tuple((int(t), float(v)) for t, v in first_token.get("top", [])),
            )

        def admit() -> RequestOutput:
            engine.pool.fill_done(res.dst)
            req.block_ids = [*res.held, *res.dst]
            req.num_computed_tokens = req.num_prompt_tokens
            req.num_committed_blocks = len(res.held)
            req.num_cached_tokens = len(res.held) * engine.cfg.block_size
            req.output_token_ids.append(int(first_token["token_id"]))
            req.all_token_ids.append(int(first_token["token_id"]))
            req.extend_block_hashes(engine.cfg.block_size)
            res.released = True  # the scheduler owns the blocks from here on
            return engine.add_prefilled(req, first_lp)

        out = await self.rt.aengine.call(admit)
        m = self.rt.metrics
        held_tokens = min(len(res.held) * engine.cfg.block_size, req.num_prompt_tokens)
        m.prefix_hit_tokens.labels("local").inc(held_tokens)
        m.prefix_hit_tokens.labels("transferred").inc(req.num_prompt_tokens - held_tokens)
        entry.queue.put_nowait(out)
        self.pending.pop(transfer_id, None)

    async def on_abort(self, transfer_id: RequestId, reason: str) -> None:
        await self.fail(transfer_id, f"KV transfer aborted: {reason}")

    def _deadline(self, entry: _Pending) -> float:
        return entry.request.deadline if entry.request is not None else time.time() + 30.0

    async def expire(self, rid: RequestId) -> None:
        if rid in self.pending:
            await self.fail(rid, "deadline passed before the KV arrived")

    async def fail(self, rid: RequestId, reason: str) -> None:
        """Ends a request still waiting for its KV: frees the reservation, ends its stream with an error."""
        entry = self.pending.get(rid)
        if entry is None:
            return
        entry.aborted = reason
        res = entry.reservation
        if res is not None and not res.released:
            res.released = True
            pool = self.rt.engine.pool
            await self.rt.aengine.call(lambda: pool.release([*res.held, *res.dst][::-1]))
        if entry.queue is not None:
            n = len(entry.request.prompt_token_ids) if entry.request else 0
            entry.queue.put_nowait(RequestOutput(rid, (), "", None, "error", n, 0, 0))
        self.pending.pop(rid, None)
        log.warning("request %s failed on the decode node: %s", rid, reason)


def _wire_logprobs(rt: NodeRuntime, out: RequestOutput) -> tuple[WireLogprob, ...] | None:
    if out.logprobs is None:
        return None
    tok = rt.engine.tokenizer

    def piece(tid: int) -> tuple[str, tuple[int, ...]]:
        text = tok.decode([tid], skip_special_tokens=False)
        return text, tuple(text.encode("utf-8"))

    result = []
    for lp in out.logprobs:
        text, raw = piece(lp.token_id)
        top = tuple(WireTop(piece(t)[0], t, v, piece(t)[1]) for t, v in lp.top)
        result.append(WireLogprob(lp.token_id, text, lp.logprob, raw, top))
    return tuple(result)


def to_step_output(rt: NodeRuntime, out: RequestOutput, error: str | None = None) -> StepOutput:
    reason = out.finish_reason
    return StepOutput(
        request_id=out.request_id,
        token_ids=out.token_ids,
        text=out.text,
        logprobs=_wire_logprobs(rt, out),
        finish_reason=reason,  # type: ignore[arg-type]
        prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens,
        cached_tokens=out.cached_tokens,
        error=error if reason in ("error", "abort") else None,
    )


def add_decode_routes(app: FastAPI, rt: NodeRuntime, handler: DecodeHandler) -> None:
    @app.post("/internal/generate")
    async def generate(request: Request) -> Any:
        try:
            gen = NodeGenerateRequest.from_json(await request.body())
            rt.engine.validate(gen.prompt_token_ids, gen.sampling)
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        if rt.draining:
            return JSONResponse({"error": f"node {rt.node_id} is draining"}, status_code=503)
        rid = RequestId(gen.request_id)
        rt.metrics.prompt_tokens.inc(len(gen.prompt_token_ids))
        if gen.prefill_node_id is None:
            engine_req = rt.engine.new_request(rid, gen.prompt_token_ids, gen.sampling, gen.cache_salt)
            outputs: AsyncIterator[RequestOutput] = rt.aengine.generate(engine_req)
        else:
            q = rt.aengine.open_stream(rid)
            entry = handler._entry(rid)
            engine_req = rt.engine.new_request(rid, gen.prompt_token_ids, gen.sampling, gen.cache_salt)
            engine_req.extend_block_hashes(rt.engine.cfg.block_size)
            entry.request, entry.engine_request, entry.queue = gen, engine_req, q
            entry.arrived.set()
            loop = asyncio.get_running_loop()
            loop.call_at(
                loop.time() + max(0.0, gen.deadline - time.time()),
                lambda: asyncio.ensure_future(handler.expire(rid)),
            )
            outputs = _remote_stream(rt, handler, rid, q)
        return StreamingResponse(_lines(rt, gen, outputs, engine_req), media_type="application/x-ndjson")


async def _remote_stream(
    rt: NodeRuntime, handler: DecodeHandler, rid: RequestId, q: asyncio.Queue[RequestOutput]
) -> AsyncIterator[RequestOutput]:
    try:
        async for out in rt.aengine.stream(rid, q):
            yield out
    finally:
        await handler.fail(rid, "client went away")


async def _lines(
    rt: NodeRuntime, gen: NodeGenerateRequest, outputs: AsyncIterator[RequestOutput], req: EngineRequest
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
                out = await asyncio.wait_for(anext(outputs), timeout=max(0.0, gen.deadline - time.time()))
            except StopAsyncIteration:
                return
            except TimeoutError:
                yield StepOutput(
                    gen.request_id,
                    (),
                    "",
                    None,
                    "error",
                    len(gen.prompt_token_ids),
                    0,
                    0,
                    "deadline exceeded",
                ).to_line()
                return
            now = time.monotonic()
            if out.token_ids:
                if first and gen.prefill_node_id is None:
                    m.prefix_hit_tokens.labels("local").inc(out.cached_tokens)
                    m.prefix_hit_tokens.labels("miss").inc(out.prompt_tokens - out.cached_tokens)
                if first:
                    m.first_token(now - t0)
                    first_at = now
                else:
                    m.inter_token(now - last, len(out.token_ids))
                first, last = False, now
                m.generation_tokens.inc(len(out.token_ids))
            error = "engine or transfer failure" if out.finish_reason == "error" else None
            yield to_step_output(rt, out, error).to_line()
            if out.finished:
                # A remotely prefilled request's queue and prefill time are the prefill node's to report.
                scheduled = req.scheduled_time if gen.prefill_node_id is None else None
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
