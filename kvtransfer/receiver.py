"""D's side of the protocol over any byte transport: the transfer server and its per-transfer state machine.

State of an accepted transfer: OPEN -> (DATA)* -> COMPLETED | ABORTED. Invariants: the terminal decision is
taken under the transfer's lock, so exactly one of `on_complete` (then ACK, rung on the channel's doorbell
first) or `on_abort` runs per accepted transfer and no handler call for it overlaps another; a transfer is in
`_transfers` exactly while it is OPEN; DATA may only name reserved destination blocks, and COMPLETE is
accepted only once every (layer, reserved block) pair has arrived. A DATA frame whose payload has not landed
when `recv` returned it (`ByteChannel.payload_landed`) is checked at once and delivered (`on_data`) by a task
once its bytes landed, while the next frames are read; a COMPLETE read meanwhile is finished by the last such
task of its transfer (its ACK then leaves before the channel may post its next receive), and the next payload
waits for that frame's release. Paths to ABORTED: P's ABORT, the deadline, a bad or corrupted frame, a handler
error, the connection dropping, and `stop()`. Each OPEN is answered from its own task (`_opening`), since the
handler may hold it until it can reserve (D's admission queue): frames of other transfers on the same
connection are never kept waiting behind it; an ABORT for a transfer still opening goes to `on_abort` (the
handler then refuses the OPEN), and a connection that ends cancels its opening tasks, whose reservations the
handler gives back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import torch
from pdserve.kvtransfer.common import (
    DTYPES,
    ChecksumError,
    ConnectionLost,
    HandshakeError,
    OpenRefused,
    OpenReply,
    PeerIdentity,
    ProtocolError,
)
from pdserve.kvtransfer.connector import ConnectorConfig, TransferHandler
from pdserve.kvtransfer.doorbell import ack_key
from pdserve.kvtransfer.framing import ByteChannel, Frame, FramedConnection
from pdserve.kvtransfer.handshake import server_handshake
from pdserve.kvtransfer.messages import Abort, Ack, Complete, Data, Error, Open, OpenOk, OpenRefusal, Ping
from pdserve.kvtransfer.open_transfer import Cols, OpenTransfer
from pdserve.kvtransfer.transport import Listener, Transport
from pdserve.shared.types import NodeId, RequestId

log = logging.getLogger("pdserve.kvtransfer")


class ChannelServer:
    def __init__(
        self, transport: Transport, config: ConnectorConfig, identity: PeerIdentity, handler: TransferHandler
    ) -> None:
        self.transport = transport
        self.config = config
        self.identity = identity
        self.handler = handler
        self._listener: Listener | None = None
        self._transfers: dict[str, OpenTransfer] = {}
        self._opening: dict[str, tuple[FramedConnection, asyncio.Task[None]]] = {}
        self._connections: dict[ByteChannel, asyncio.Future[None]] = {}
        # the tasks answering OPENs and delivering payloads that are still landing
        self._landings: set[asyncio.Future[None]] = set()
        self._stopping = False  # connections arriving during stop() are cut at once

    @property
    def address(self) -> str:
        assert self._listener is not None, "address is known once the server started"
        return f"{self.transport.scheme}://{self.config.listen_host}:{self._listener.port}"

    def open_transfer_ids(self) -> frozenset[RequestId]:
        return frozenset(RequestId(tid) for tid in self._transfers)

    async def start(self) -> None:
        assert self._listener is None, "server already started"
        self._listener = await self.transport.listen(
            self.config.listen_host, self.config.listen_port, self._serve
        )
        log.info("KV receiver %s listening on %s", self.identity.node_id, self.address)

    async def stop(self) -> None:
        """Connections first (their handlers end before a transport's listener goes), then the listener."""
        self._stopping = True
        for _, task in list(self._opening.values()):
            task.cancel()
        for channel in list(self._connections):
            channel.abort()
        await asyncio.gather(*self._connections.values())
        await asyncio.gather(*self._landings, return_exceptions=True)  # channels cut: they end at once
        await asyncio.sleep(0)  # let the transports' accept wrappers around _serve return
        if self._listener is not None:
            await self._listener.close()
            self._listener = None
        self._stopping = False

    async def _serve(self, channel: ByteChannel) -> None:
        if self._stopping:
            channel.abort()
            return
        done = asyncio.get_running_loop().create_future()
        self._connections[channel] = done
        conn = FramedConnection(channel, self.config.max_payload_bytes)
        reason, peer_id = "connection closed", channel.peer
        alive: list[asyncio.Task[None]] = []
        try:
            hello_id = await self._handshake(conn)
            if hello_id is None:
                return
            peer_id = hello_id
            window = self.config.liveness_s  # D cuts a silent sender: its transfers then fail over
            alive = [asyncio.create_task(conn.keep_alive(window)), asyncio.create_task(conn.watch(window))]
            while True:
                try:
                    frame = await conn.recv()
                except ChecksumError as e:
                    t = self._transfers.get(e.transfer_id or "")
                    if t is None or t.conn is not conn:
                        raise
                    log.error("corrupted frame from %s: %s", peer_id, e)
                    await self._abort(t, f"corrupted frame: {e}", notify=True)
                    continue
                await self._dispatch(conn, NodeId(peer_id), frame)
        except ProtocolError as e:
            reason = f"protocol error: {e}"
            log.warning("closing connection from %s: %s", peer_id, reason)
            with contextlib.suppress(ConnectionLost):
                await conn.send(Error("protocol", str(e)))
        except ConnectionLost as e:
            reason = conn.silent or f"connection lost: {e}"
        finally:
            channel.abort()
            for task in alive:
                task.cancel()
            opening = [task for c, task in self._opening.values() if c is conn]
            for task in opening:
                task.cancel()
            await asyncio.gather(*opening, return_exceptions=True)
            for t in [t for t in self._transfers.values() if t.conn is conn]:
                await self._abort(t, f"connection from {peer_id} ended ({reason})", notify=False)
            if conn.silent is not None:
                await self._call_quietly(self.handler.on_peer_silent(NodeId(peer_id), conn.silent))
            del self._connections[channel]
            done.set_result(None)

    async def _handshake(self, conn: FramedConnection) -> str | None:
        """The sender's node id, or None (logged) when it is refused or leaves before READY."""
        try:
            hello = await server_handshake(conn, self.config, self.identity)
        except (HandshakeError, ProtocolError, ConnectionLost) as e:
            log.warning("refused sender from %s: %s", conn.channel.peer, e)
        else:
            log.info(
                "accepted sender %s from %s, checksum=%s", hello.node_id, conn.channel.peer, conn.checksum
            )
            return hello.node_id
        return None

    async def _dispatch(self, conn: FramedConnection, peer_id: NodeId, frame: Frame) -> None:
        msg = frame.msg
        if frame.payload is not None and not isinstance(msg, Data):
            raise ProtocolError(f"{type(msg).__name__} must not carry a payload")
        if isinstance(msg, Ping):  # heard: the channel noted when
            return
        if isinstance(msg, Open):
            self._start_open(conn, peer_id, msg)
            return
        if not isinstance(msg, Data | Complete | Abort):
            raise ProtocolError(f"unexpected {type(msg).__name__} from a sender")
        opening = self._opening.get(msg.transfer_id)
        if isinstance(msg, Abort) and opening is not None and opening[0] is conn:
            await self._call_on_abort(RequestId(msg.transfer_id), f"sender aborted: {msg.reason}")
            return
        t = self._transfers.get(msg.transfer_id)
        # e.g. DATA still in flight after the deadline aborted it, or after COMPLETE
        if t is None or t.conn is not conn or t.complete is not None:
            log.debug(
                "dropping %s for transfer %r that is not open here", type(msg).__name__, msg.transfer_id
            )
        elif isinstance(msg, Data):
            await self._data(t, msg, frame.payload)
        elif isinstance(msg, Complete):
            await self._complete(t, msg)
        else:
            await self._abort(t, f"sender aborted: {msg.reason}", notify=False)

    def _start_open(self, conn: FramedConnection, peer_id: NodeId, msg: Open) -> None:
        tid = msg.transfer_id
        if tid in self._transfers or tid in self._opening:
            refusal = OpenRefusal(RequestId(tid), "transfer id is already open")
            task = asyncio.ensure_future(self._send_quietly(conn, refusal))
        else:
            task = asyncio.ensure_future(self._open(conn, peer_id, msg))
            self._opening[tid] = (conn, task)
            task.add_done_callback(lambda _: self._opening.pop(tid, None))
        self._landings.add(task)
        task.add_done_callback(self._landed)

    async def _send_quietly(self, conn: FramedConnection, msg: OpenRefusal) -> None:
        with contextlib.suppress(ConnectionLost):
            await conn.send(msg)

    async def _open(self, conn: FramedConnection, peer_id: NodeId, msg: Open) -> None:
        tid = msg.transfer_id
        refusal: str | None = None
        reply: OpenReply | None = None
        if msg.deadline <= time.time():
            refusal = f"deadline {msg.deadline:.3f} has passed (now {time.time():.3f})"
        elif msg.num_blocks <= 0 or len(msg.block_hashes) > msg.num_blocks:
            refusal = f"bad OPEN: num_blocks={msg.num_blocks}, {len(msg.block_hashes)} block hashes"
        else:
            try:
                reply = await self.handler.on_open(peer_id, msg)
            except OpenRefused as e:
                refusal = e.reason
            except asyncio.CancelledError:
                raise  # the connection ended: the handler gave back what it had reserved
            except Exception as e:
                log.exception("on_open(%r) failed", tid)
                refusal = f"receiver error in on_open: {e!r}"
        if reply is not None and reply.num_blocks != msg.num_blocks:
            refusal = f"receiver reserved {reply.num_blocks} blocks for a {msg.num_blocks}-block request"
            await self._call_on_abort(tid, refusal)
        if refusal is not None:
            log.info("refused transfer %r from %s: %s", tid, peer_id, refusal)
            await self._send_quietly(conn, OpenRefusal(tid, refusal))
            return
        assert reply is not None
        if conn.channel not in self._connections:  # the connection ended while the handler reserved
            await self._call_on_abort(tid, "connection ended before OPEN was answered")
            return
        t = OpenTransfer(tid, conn, reply, msg.deadline, self.identity.layout.num_layers)
        self._transfers[tid] = t
        t.expiry = asyncio.create_task(self._expire(t))
        with contextlib.suppress(ConnectionLost):
            await conn.send(OpenOk(tid, reply.num_held_blocks, tuple(reply.dst_block_ids)))

    async def _data(self, t: OpenTransfer, msg: Data, payload: torch.Tensor | None) -> None:
        blocks = t.blocks_of(msg, payload, self.identity.layout)
        if isinstance(blocks, str):
            await self._abort(t, blocks, notify=True)
            return
        assert payload is not None
        lay, n = self.identity.layout, len(msg.block_indices)
        # buffer: [num_layers, 2, n, block_size, Hkv, D]
        buffer = payload.view(DTYPES[lay.dtype]).view(
            msg.num_layers, 2, n, lay.block_size, lay.num_kv_heads, lay.head_dim
        )
        if t.conn.channel.payload_landed():
            await self._deliver(t, msg, buffer, blocks)
            return
        # The bytes are still landing (the checks above ran meanwhile): deliver them from a task, so the next
        # frames, COMPLETE typically, are read and checked before they land, not after.
        release = t.conn.defer_release()
        t.landing += 1
        task = asyncio.ensure_future(self._land(t, msg, buffer, blocks, release))
        self._landings.add(task)
        task.add_done_callback(self._landed)

    def _landed(self, task: asyncio.Future[None]) -> None:
        """A delivery task ended. One that raised is a bug: logged; its transfer ends at its deadline."""
        self._landings.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("delivering a landed payload failed", exc_info=task.exception())

    async def _land(
        self,
        t: OpenTransfer,
        msg: Data,
        buffer: torch.Tensor,
        blocks: tuple[torch.Tensor, Cols],
        release: Callable[[], None],
    ) -> None:
        try:
            # A failed landing kills the connection: its reader then aborts the connection's transfers.
            with contextlib.suppress(ConnectionLost):
                await t.conn.channel.landed()
                await self._deliver(t, msg, buffer, blocks)
                t.landing -= 1
                if not t.landing and t.complete is not None:
                    await self._finish(t, t.complete)
        finally:
            release()

    async def _deliver(
        self, t: OpenTransfer, msg: Data, buffer: torch.Tensor, blocks: tuple[torch.Tensor, Cols]
    ) -> None:
        """Hand a landed payload (as [num_layers, 2, n, block_size, Hkv, D]) to `on_data` and mark its
        layer-blocks received."""
        dst, cols = blocks
        async with t.lock:
            if t.done:
                return
            try:
                await self.handler.on_data(t.tid, msg.layer_start, dst, buffer)
            except Exception as e:
                log.exception("on_data(%r) failed", t.tid)
                failure = f"receiver error in on_data: {e!r}"
            else:
                t.received[msg.layer_start : msg.layer_start + msg.num_layers, cols] = True
                return
        await self._abort(t, failure, notify=True)

    async def _complete(self, t: OpenTransfer, msg: Complete) -> None:
        if t.landing:  # the last DATA still landing finishes the transfer once it was delivered
            t.complete = msg
            return
        await self._finish(t, msg)

    async def _finish(self, t: OpenTransfer, msg: Complete) -> None:
        """COMPLETE once every DATA before it was delivered: nothing missing, then on_complete and ACK."""
        missing = int((~t.received).sum())
        if missing:
            await self._abort(t, f"COMPLETE with {missing} of {t.received.size} layer-blocks missing", True)
            return
        await t.conn.channel.flush()  # every payload landed; ConnectionLost if not
        async with t.lock:
            if t.done:
                return
            try:
                await self.handler.on_complete(t.tid, msg.first_token)
            except Exception as e:
                log.exception("on_complete(%r) failed", t.tid)
                failure = f"receiver error in on_complete: {e!r}"
            else:
                self._end(t)
                t.conn.channel.ring_ack(ack_key(t.tid, t.deadline))  # a peer on this host may take it there
                with contextlib.suppress(ConnectionLost):
                    await t.conn.send(Ack(t.tid))
                return
        await self._abort(t, failure, notify=True)

    def _end(self, t: OpenTransfer) -> None:
        t.done = True
        del self._transfers[t.tid]
        if t.expiry is not None and t.expiry is not asyncio.current_task():
            t.expiry.cancel()

    async def _abort(self, t: OpenTransfer, reason: str, notify: bool) -> None:
        async with t.lock:
            if t.done:
                return
            self._end(t)
            log.warning("aborting transfer %r: %s", t.tid, reason)
            await self._call_on_abort(t.tid, reason)
        if notify:
            with contextlib.suppress(ConnectionLost):
                await t.conn.send(Abort(t.tid, reason))

    async def _call_on_abort(self, tid: RequestId, reason: str) -> None:
        try:
            await self.handler.on_abort(tid, reason)
        except Exception:
            log.exception("on_abort(%r) failed; its reservation may leak", tid)

    async def _call_quietly(self, call: Awaitable[None]) -> None:
        try:
            await call
        except Exception:
            log.exception("the transfer handler failed")

    async def _expire(self, t: OpenTransfer) -> None:
        await asyncio.sleep(max(t.deadline - time.time(), 0.0))
        await self._abort(t, f"deadline {t.deadline:.3f} passed", notify=True)
