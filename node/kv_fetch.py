"""Cross-node prefix reuse: a node holding prefix blocks exports them to a prefill node that lacks them,
which imports them into reserved blocks and then computes only the rest of the prompt.

The holder is the transfer's sender and the fetcher its receiver, so a fetch has the handshake, auth, layout
check, deadline and abort of every KV transfer, over whichever connector the cluster runs (kvtransfer's
public API only). The fetcher asks with `POST /internal/export` (ExportRequest); the holder pins the prefix
it still has (`hold_prefix`: fewer blocks than asked when the index was stale, never other ones), opens a
transfer carrying exactly those hashes, sends the blocks the fetcher's OPEN reply lacks, a frame per
`layers_per_frame` layers gathered on its engine thread (`export_layer`), completes, and unpins.

Invariants: the holder's pins are released on every path; a fetch reservation on the fetcher (a
`KVReservation`, node/reservation.py) ends exactly once: released at once on abort, failure or
cancellation, or committed on COMPLETE (`commit_fetched`) and released by the fetching request once its
prefill has matched it (`PrefixFetcher.release`), its blocks then CACHED; an OPEN for a fetch nobody waits for
is refused, and one reserved while the fetcher stopped waiting is given back. A short or failed fetch is never
an error: the prefill computes what did not arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx2
import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pdserve.kvtransfer.connector import (
    FrameBlocks,
    KVSender,
    KVTransferError,
    Open,
    OpenRefused,
    OpenReply,
    TransferHandler,
    TransferSession,
)
from pdserve.kvtransfer.device_sync import event_done
from pdserve.node.node_routes import message_response
from pdserve.node.node_runtime import NodeRuntime
from pdserve.node.reservation import KVReservation, Reservations
from pdserve.shared.engine.engine import RemoteReservation
from pdserve.shared.node.node_protocol import ExportRequest, ExportResult
from pdserve.shared.node.node_sign import signed
from pdserve.shared.types import BlockHash, BlockId, FirstToken, NodeId, RequestId

log = logging.getLogger(__name__)


class PrefixExporter:
    """The holder's side: serves ExportRequests with the node's KV sender (created on first use)."""

    def __init__(self, rt: NodeRuntime, sender: Callable[[], KVSender], layers_per_frame: int = 4) -> None:
        self.rt = rt
        self._sender = sender
        self.layers_per_frame = layers_per_frame

    def _gather(self, src: list[BlockId], first: int, n_layers: int) -> tuple[torch.Tensor, Any]:
        """Engine thread: layers [first, first + n_layers) of blocks `src` into a private buffer."""
        engine = self.rt.engine
        buf = engine.export_buffer(n_layers, len(src))  # [n_layers, 2, n, B, Hkv, D]
        ids = torch.tensor(src, dtype=torch.int64, device=buf.device)
        for i in range(n_layers):
            engine.export_layer(first + i, ids, buf[i])
        event = None
        if buf.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(buf.device))
        return buf, event

    async def export(self, req: ExportRequest) -> ExportResult:
        engine, aengine = self.rt.engine, self.rt.aengine
        hashes = [BlockHash(h) for h in req.block_hashes]
        held = await aengine.call(lambda: engine.hold_prefix(hashes))
        session: TransferSession | None = None
        sent = 0
        try:
            if not held:
                return ExportResult(0, 0)
            async with asyncio.timeout(max(0.0, req.deadline - time.time())):
                session = await self._sender().session(req.fetcher_transfer_addr, req.transfer_id)
                reply: OpenReply = await session.open(hashes[: len(held)], len(held), req.deadline)
                b0 = reply.num_held_blocks
                src = list(held[b0:])
                if src:
                    blocks = FrameBlocks.run(reply, b0, src)
                    num_layers, per = engine.num_layers, self.layers_per_frame
                    # one engine call per frame: a frame is sent while the next one is gathered (gathering
                    # every frame first measured 10 ms slower for a 16k-token prefix on an H100)
                    for first in range(0, num_layers, per):
                        gather = functools.partial(self._gather, src, first, min(per, num_layers - first))
                        buf, event = await aengine.call(gather)
                        if event is not None:
                            await event_done(event)
                        await session.send_layers(first, blocks, buf)
                stats = await session.complete(None)
                sent = len(src)
            m = self.rt.metrics
            m.transfer_bytes.labels(self.rt.connector_kind, "out").inc(stats.payload_bytes)
            m.exported_blocks.inc(sent)
            await self.rt.mover.pulled(hashes[: len(held)])  # a moved request's KV, once pulled, is unpinned
            return ExportResult(len(held), sent)
        except (KVTransferError, TimeoutError, ValueError) as exc:
            reason = str(exc) or type(exc).__name__
            if session is not None:
                with contextlib.suppress(KVTransferError):
                    await session.abort(reason)
            return ExportResult(len(held), 0, error=f"export failed: {reason}")
        except BaseException:
            if session is not None:
                with contextlib.suppress(KVTransferError):
                    await asyncio.shield(session.abort("export cancelled"))
            raise
        finally:
            if held:
                await asyncio.shield(aengine.call(lambda: engine.release_held(held)))


@dataclass
class _Fetch:
    hashes: tuple[BlockHash, ...]
    reservation: KVReservation = field(default_factory=KVReservation)
    committed: bool = False
    ended: bool = False


class FetchReceiver(TransferHandler):
    """The fetcher's receiving end: reserves for an OPEN only when a fetch of that transfer id is waiting."""

    def __init__(self, rt: NodeRuntime) -> None:
        self.rt = rt
        self.pending: dict[RequestId, _Fetch] = {}
        self.reservations = Reservations(rt)

    async def on_open(self, peer: NodeId, req: Open) -> OpenReply:
        f = self.pending.get(req.transfer_id)
        if f is None or f.ended or f.reservation.blocks is not None:
            raise OpenRefused("no prefix fetch is waiting for this transfer")
        if req.num_blocks != len(req.block_hashes) or tuple(req.block_hashes) != f.hashes[: req.num_blocks]:
            raise OpenRefused("the holder offered blocks that were not asked for")
        reservation = await self.reservations.reserve(req.block_hashes, req.num_blocks)
        res = reservation.blocks
        if res is None:
            raise OpenRefused("no free KV blocks for the fetched prefix")
        if f.ended:  # the fetcher stopped waiting while the engine reserved
            await reservation.release()
            raise OpenRefused("the fetch ended on the fetching node")
        f.reservation = reservation
        return OpenReply(len(res.held), tuple(res.dst))

    def _live(self, transfer_id: RequestId) -> tuple[_Fetch, RemoteReservation]:
        f = self.pending.get(transfer_id)
        res = None if f is None or f.ended else f.reservation.blocks
        if f is None or res is None:
            raise RuntimeError(f"fetch {transfer_id} was aborted on the fetching node")
        return f, res

    async def on_data(
        self, transfer_id: RequestId, layer_start: int, dst_block_ids: torch.Tensor, buffer: torch.Tensor
    ) -> None:
        self._live(transfer_id)
        # queued on the current stream (the connector waits for it); nobody else reads reserved blocks
        self.rt.engine.import_layers(layer_start, dst_block_ids, buffer)
        self.rt.metrics.transfer_bytes.labels(self.rt.connector_kind, "in").inc(buffer.nbytes)

    async def on_complete(self, transfer_id: RequestId, first_token: FirstToken | None) -> None:
        f, res = self._live(transfer_id)
        engine = self.rt.engine
        await self.rt.aengine.call(lambda: engine.commit_fetched(res, f.hashes))
        f.committed = True

    async def on_abort(self, transfer_id: RequestId, reason: str) -> None:
        f = self.pending.get(transfer_id)
        if f is None or f.reservation.blocks is None or f.committed:
            return
        await f.reservation.release()
        log.info("prefix fetch %s aborted: %s", transfer_id, reason)

    async def on_peer_silent(self, peer: NodeId, reason: str) -> None:
        """A holder went silent: its fetches were aborted first (on_abort gave their blocks back) and the
        fetching requests compute what did not come."""
        log.warning("prefix holder %s went silent: %s", peer, reason)


@dataclass(frozen=True)
class FetchedPrefix:
    """What one fetch brought: `landed` blocks came over the link into `reservation` (released by
    PrefixFetcher.release), `holder_blocks` of the asked ones were still on the holder."""

    asked_blocks: int
    holder_blocks: int
    landed: int
    reservation: KVReservation


class PrefixFetcher:
    """The fetcher's side: asks a holder to export and waits for the transfer into `receiver` to land."""

    def __init__(self, rt: NodeRuntime, receiver: FetchReceiver, transfer_addr: str, auth_token: str) -> None:
        self.rt = rt
        self.receiver = receiver
        self.transfer_addr = transfer_addr
        self._client = httpx2.AsyncClient(auth=signed(auth_token), timeout=None)  # each call signed

    async def fetch_for(
        self,
        request_id: RequestId,
        prompt_len: int,
        hashes: Sequence[BlockHash],
        holder_url: str | None,
        holder_blocks: int,
        deadline: float,
    ) -> FetchedPrefix | None:
        """Fetches the leading prompt blocks the router said `holder_url` holds (`holder_blocks` of them) and
        this node lacks, never the block holding the prompt's last token (the engine computes at least that
        token); None when there is nothing to fetch. Call `release` with a result once the prefill that
        uses it ended."""
        engine = self.rt.engine
        want = min(holder_blocks, (prompt_len - 1) // engine.cfg.block_size)
        if holder_url is None or want <= 0:
            return None
        wanted = hashes[:want]
        local = await self.rt.aengine.call(lambda: engine.cached_prefix_blocks(wanted))
        if local >= want:
            return None
        return await self.fetch(request_id, holder_url, wanted, local, deadline)

    async def fetch(
        self,
        request_id: RequestId,
        holder_url: str,
        hashes: Sequence[BlockHash],
        local_blocks: int,
        deadline: float,
    ) -> FetchedPrefix:
        """Fetches the leading `hashes` (this node holds the first `local_blocks`) from the holder at
        `holder_url` (its internal URL); never raises for a short or failed fetch: the blocks that did not
        come are counted as misses. Call `release` with the result once the prefill that uses it ended."""
        tid = RequestId(f"{request_id}/fetch")
        f = _Fetch(tuple(hashes))
        self.receiver.pending[tid] = f
        done = False
        result: ExportResult | None = None
        try:
            body = ExportRequest(tid, tuple(hashes), self.transfer_addr, deadline).to_json()
            try:
                async with asyncio.timeout(max(0.0, deadline - time.time())):
                    reply = await self._client.post(f"{holder_url}/internal/export", content=body)
                result = ExportResult.from_json(reply.content)
                if result.error is not None:
                    log.warning("prefix fetch %s from %s: %s", tid, holder_url, result.error)
            except (httpx2.HTTPError, TimeoutError, ValueError) as exc:
                log.warning("prefix fetch %s from %s failed: %s", tid, holder_url, exc or type(exc).__name__)
            kept = f.reservation if f.committed else KVReservation()
            res = kept.blocks
            landed = 0 if res is None else len(res.dst)
            have = local_blocks if res is None else max(local_blocks, len(res.held) + landed)
            m = self.rt.metrics
            m.fetched_blocks.inc(landed)
            m.fetch_miss_blocks.inc(len(hashes) - have)
            done = True
            return FetchedPrefix(len(hashes), 0 if result is None else result.held_blocks, landed, kept)
        finally:
            self.receiver.pending.pop(tid, None)
            f.ended = True
            if not (done and f.committed):
                await f.reservation.release()

    async def release(self, fetched: FetchedPrefix) -> None:
        await fetched.reservation.release()

    async def close(self) -> None:
        await self._client.aclose()


def add_export_route(app: FastAPI, exporter: PrefixExporter) -> None:
    @app.post("/internal/export")
    async def export(request: Request) -> Response:
        try:
            req = ExportRequest.from_json(await request.body())
        except ValueError as exc:
            return message_response(ExportResult(0, 0, error=str(exc)), 400)
        result = await exporter.export(req)
        status = 200 if result.error is None else 502
        return message_response(result, status)
