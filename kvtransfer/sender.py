"""P's side of the protocol over any byte transport: one cached connection per peer, sessions multiplexed.

Invariants: a connection's reader task is the only reader of its channel; a session is registered on its
connection from construction until it completes, is aborted (by either end) or the connection dies, and
each of those ends fails its pending waits exactly once with `TransferAborted`. A dead connection is
dropped from the cache, so the next session to that peer dials again. No DATA send outlives the request's
deadline: one still going out then cuts the connection (a half-sent frame would end it anyway).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Sequence

import torch
from pdserve.kvtransfer.common import (
    DTYPES,
    ConnectionLost,
    FrameBlocks,
    HandshakeError,
    KVLayout,
    KVTransferError,
    OpenReply,
    PeerIdentity,
    ProtocolError,
    TransferAborted,
    TransferRefused,
    TransferStats,
    check_layers,
)
from pdserve.kvtransfer.connector import ConnectorConfig
from pdserve.kvtransfer.device_sync import SPIN_S, stream_idle
from pdserve.kvtransfer.doorbell import ack_key as doorbell_key
from pdserve.kvtransfer.framing import FramedConnection
from pdserve.kvtransfer.handshake import client_handshake
from pdserve.kvtransfer.messages import (
    Abort,
    Ack,
    Complete,
    Data,
    Error,
    Message,
    Open,
    OpenOk,
    OpenRefusal,
    Ping,
)
from pdserve.kvtransfer.transport import Transport, parse_address
from pdserve.shared.types import BlockHash, BlockId, FirstToken, RequestId

log = logging.getLogger("pdserve.kvtransfer")
_LATE = "DATA not delivered by the deadline"


class _PeerConnection:
    def __init__(
        self, conn: FramedConnection, peer_id: str, config: ConnectorConfig, layout: KVLayout
    ) -> None:
        self.conn = conn
        self.peer_id = peer_id
        self.config = config
        self.layout = layout
        self.sessions: dict[str, ChannelSession] = {}
        self.lost: str | None = None
        self.reader = asyncio.create_task(self._read_loop())
        # P only pings: D cuts a silent connection (and fails its transfers over); a silent D holds P's
        # sessions until the request's deadline, as P's requests cannot finish without it anyway.
        self.alive = asyncio.create_task(conn.keep_alive(config.liveness_s))

    async def _read_loop(self) -> None:
        reason = "connection closed"
        try:
            while True:
                frame = await self.conn.recv()
                if frame.payload is not None:
                    raise ProtocolError(f"receiver sent a payload on {type(frame.msg).__name__}")
                self._dispatch(frame.msg)
        except (ConnectionLost, ProtocolError) as e:
            reason = f"connection to {self.peer_id} lost: {e}"
            log.warning("%s", reason)
        finally:
            self.lost = reason
            self.conn.channel.abort()
            self.alive.cancel()
            for session in list(self.sessions.values()):
                session._fail(reason)

    def _dispatch(self, msg: Message) -> None:
        if isinstance(msg, Ping):  # heard: the channel noted when
            return
        if isinstance(msg, Error):
            raise ProtocolError(f"receiver sent ERROR {msg.code}: {msg.detail}")
        if not isinstance(msg, OpenOk | OpenRefusal | Ack | Abort):
            raise ProtocolError(f"receiver sent unexpected {type(msg).__name__}")
        session = self.sessions.get(msg.transfer_id)
        if session is None:  # a late reply to a session this end already ended
            log.debug("dropping %s for finished transfer %r", type(msg).__name__, msg.transfer_id)
            return
        session._on_message(msg)

    def new_session(self, transfer_id: RequestId) -> ChannelSession:
        if self.lost is not None:
            raise ConnectionLost(self.lost)
        if transfer_id in self.sessions:
            raise ValueError(f"transfer {transfer_id!r} already has a session to {self.peer_id}")
        session = ChannelSession(self, transfer_id)
        self.sessions[transfer_id] = session
        return session

    async def close(self) -> None:
        for session in list(self.sessions.values()):
            await session.abort("sender closing")
        self.reader.cancel()
        self.alive.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.reader
        await self.conn.channel.close()


class ChannelSession:
    """One transfer. Not safe for concurrent calls on the same session (one request, one coroutine)."""

    def __init__(self, connection: _PeerConnection, transfer_id: RequestId) -> None:
        self._connection = connection
        self._transfer_id = transfer_id
        self._reply: OpenReply | None = None
        self._deadline = 0.0
        self._waiter: asyncio.Future[Message] | None = None
        self._ended: str | None = None  # why the session can no longer be used
        self._first_send: float | None = None
        self._payload_bytes = 0
        # One timer per session for the deadline (a timeout scope per DATA frame costs more than the
        # frame's header): `_on_deadline` cuts a send in flight.
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._late = False
        self._sending = False

    @property
    def transfer_id(self) -> RequestId:
        return self._transfer_id

    def _on_message(self, msg: Message) -> None:
        if isinstance(msg, Abort):
            self._fail(f"receiver aborted: {msg.reason}")
        elif self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(msg)
        else:
            log.warning("unexpected %s for transfer %r", type(msg).__name__, self._transfer_id)

    def _end(self, reason: str) -> None:
        self._ended = reason
        self._connection.sessions.pop(self._transfer_id, None)
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()

    def _fail(self, reason: str) -> None:
        if self._ended is not None:
            return
        self._end(reason)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(TransferAborted(self._transfer_id, reason))

    def _check_usable(self) -> None:
        if self._ended is not None:
            raise TransferAborted(self._transfer_id, self._ended)

    async def _send(self, msg: Message, payload: torch.Tensor | None = None) -> None:
        try:
            await self._connection.conn.send(msg, payload)
        except ConnectionLost as e:
            self._fail(f"connection lost while sending: {e}")
            raise TransferAborted(self._transfer_id, self._ended or str(e)) from e

    async def _request(
        self, msg: Message, until: float, what: str, spin: bool = False, ack_key: bytes | None = None
    ) -> Message:
        """Send `msg` and wait for the reply to it until unix time `until`. With `spin`, the loop keeps
        turning for up to SPIN_S before it blocks: a reply expected within a millisecond or two is then
        seen at once, not after the wake-up of an idle core (docs/kv_transfer_protocol.md, "Measurements").
        With `ack_key`, a ring of that key on the channel's ACK doorbell (same-host peers) seen while spinning
        is the ACK: it is returned as one, and the ACK frame that follows finds the session ended."""
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._send(msg)
            if spin:
                channel = self._connection.conn.channel
                spin_until = time.perf_counter() + SPIN_S
                while not waiter.done() and time.perf_counter() < spin_until:
                    if ack_key is not None and channel.ack_rung(ack_key):
                        return Ack(self._transfer_id)
                    await asyncio.sleep(0)
            if waiter.done():  # seen while spinning: no timeout scope to set up
                return waiter.result()
            async with asyncio.timeout(max(until - time.time(), 0.0)):
                return await waiter
        except TimeoutError:
            await self.abort(f"no {what} from receiver by the deadline")
            raise TransferAborted(self._transfer_id, f"no {what} by the deadline") from None
        finally:
            self._waiter = None
            if waiter.done() and not waiter.cancelled():
                waiter.exception()  # a failure nobody awaited (the send itself failed) is not logged as lost

    async def open(self, block_hashes: Sequence[BlockHash], num_blocks: int, deadline: float) -> OpenReply:
        self._check_usable()
        if self._reply is not None:
            raise ValueError(f"transfer {self._transfer_id!r} is already open")
        if len(block_hashes) > num_blocks:
            raise ValueError(f"{len(block_hashes)} block hashes but only {num_blocks} blocks")
        if deadline <= time.time():
            self._end("deadline passed before OPEN")
            raise TransferRefused(self._transfer_id, f"deadline {deadline:.3f} passed before OPEN was sent")
        self._deadline = deadline
        loop = asyncio.get_running_loop()
        self._deadline_timer = loop.call_at(loop.time() + deadline - time.time(), self._on_deadline)
        msg = Open(self._transfer_id, tuple(block_hashes), num_blocks, deadline)
        reply = await self._request(msg, deadline, "OPEN reply")
        if isinstance(reply, OpenRefusal):
            self._end(f"refused: {reply.reason}")
            raise TransferRefused(self._transfer_id, reply.reason)
        assert isinstance(reply, OpenOk)
        self._reply = OpenReply(reply.num_held_blocks, tuple(BlockId(b) for b in reply.dst_block_ids))
        if self._reply.num_blocks != num_blocks:
            await self.abort(f"reply covers {self._reply.num_blocks} blocks, asked for {num_blocks}")
            raise TransferAborted(self._transfer_id, f"receiver reserved {self._reply.num_blocks} blocks")
        return self._reply

    def _data_msg(self, layer_start: int, blocks: FrameBlocks, buffer: torch.Tensor) -> Data:
        """The DATA header of a buffer [nl, 2, n, B, Hkv, D], or ValueError when it breaks the reservation."""
        reply, layout = self._reply, self._connection.layout
        assert reply is not None, "send_layers before open"
        expected = (2, len(blocks), layout.block_size, layout.num_kv_heads, layout.head_dim)
        if tuple(buffer.shape[1:]) != expected or buffer.dtype != DTYPES[layout.dtype]:
            raise ValueError(
                f"buffer {tuple(buffer.shape)} {buffer.dtype} != [nl, *{expected}] {layout.dtype}"
            )
        check_layers(layer_start, int(buffer.shape[0]), layout)
        reply.columns(blocks.indices, blocks.dst)
        return Data(
            self._transfer_id, layer_start, int(buffer.shape[0]), blocks.indices, blocks.src, blocks.dst
        )

    def _on_deadline(self) -> None:
        """The request's deadline passed: a DATA frame still going out cuts the connection (a frame cut
        midway leaves it unusable, and a GPU op in flight); later sends are refused."""
        self._late = True
        if self._sending:
            self._connection.conn.channel.abort()
            self._fail(_LATE)

    async def send_layers(self, layer_start: int, blocks: FrameBlocks, buffer: torch.Tensor) -> None:
        self._check_usable()
        if buffer.dim() == 5:
            buffer = buffer.unsqueeze(0)
        limit = self._connection.conn.channel.payload_limit
        nbytes = buffer.numel() * buffer.element_size()
        if limit is not None and nbytes > limit and buffer.shape[0] > 1:
            # the channel's frames are bounded (ByteChannel.payload_limit): send the layers in groups that fit
            per_group = max(1, limit // (nbytes // buffer.shape[0]))
            for first in range(0, buffer.shape[0], per_group):
                await self.send_layers(layer_start + first, blocks, buffer[first : first + per_group])
            return
        if self._late:
            self._fail(_LATE)
            raise TransferAborted(self._transfer_id, _LATE)
        start = time.perf_counter()
        if not buffer.is_contiguous():
            buffer = buffer.contiguous()
            if buffer.is_cuda:  # the copy must land before a GPU connector reads it
                await stream_idle(torch.cuda.current_stream(buffer.device))
        self._sending = True
        try:
            # the header is checked and built inside: an early-payload channel moves the payload meanwhile
            build = functools.partial(self._data_msg, layer_start, blocks, buffer)
            await self._connection.conn.send_built(build, buffer)
        except ConnectionLost as e:
            self._fail(f"connection lost while sending: {e}")
            raise TransferAborted(self._transfer_id, self._ended or str(e)) from e
        finally:
            self._sending = False
        if self._first_send is None:
            self._first_send = start
        self._payload_bytes += nbytes

    async def complete(self, first_token: FirstToken | None) -> TransferStats:
        self._check_usable()
        if self._reply is None:
            raise ValueError(f"complete before open on transfer {self._transfer_id!r}")
        start = self._first_send if self._first_send is not None else time.perf_counter()
        until = self._deadline + self._connection.config.ack_grace_s
        msg = Complete(self._transfer_id, first_token)
        key = doorbell_key(self._transfer_id, self._deadline)
        reply = await self._request(msg, until, "ACK", spin=True, ack_key=key)
        assert isinstance(reply, Ack), reply
        self._end("completed")
        return TransferStats(self._transfer_id, self._payload_bytes, time.perf_counter() - start)

    async def abort(self, reason: str) -> None:
        if self._ended is not None:
            return
        self._fail(f"sender aborted: {reason}")
        with contextlib.suppress(ConnectionLost):  # a dead connection already aborts on D's side
            await self._connection.conn.send(Abort(self._transfer_id, reason))


class ChannelSender:
    def __init__(self, transport: Transport, config: ConnectorConfig, identity: PeerIdentity) -> None:
        self.transport = transport
        self.config = config
        self.identity = identity
        self._connections: dict[str, asyncio.Task[_PeerConnection]] = {}

    async def session(self, peer_address: str, transfer_id: RequestId) -> ChannelSession:
        task = self._connections.get(peer_address)
        if task is not None and task.done() and (task.cancelled() or task.exception() or task.result().lost):
            task = None
        if task is None:
            task = asyncio.create_task(self._connect(peer_address))
            self._connections[peer_address] = task
        try:
            connection = await asyncio.shield(task)
        except BaseException:
            if self._connections.get(peer_address) is task and task.done():
                del self._connections[peer_address]
            raise
        return connection.new_session(transfer_id)

    async def _connect(self, address: str) -> _PeerConnection:
        host, port = parse_address(address, self.transport.scheme)
        channel = await self.transport.dial(host, port, self.config.connect_timeout_s)
        conn = FramedConnection(channel, self.config.max_payload_bytes)
        try:
            peer = await client_handshake(conn, self.config, self.identity)
        except (HandshakeError, ProtocolError, ConnectionLost) as e:
            channel.abort()
            log.warning("handshake with %s failed: %s", address, e)
            raise
        log.info("connected to %s (%s), checksum=%s", peer.node_id, address, conn.checksum)
        return _PeerConnection(conn, peer.node_id, self.config, self.identity.layout)

    async def close(self) -> None:
        tasks, self._connections = list(self._connections.values()), {}
        for task in tasks:
            task.cancel()  # a no-op once connected
            try:
                connection = await task
            except (asyncio.CancelledError, KVTransferError, OSError):
                continue
            await connection.close()
