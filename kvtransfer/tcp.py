"""The TCP connector: length-prefixed protocol frames over a socket, read and written without asyncio streams.

A payload is received straight into its tensor: the protocol (`_Stream`, an `asyncio.BufferedProtocol`)
hands the socket the tensor's memory while a payload is being read, and a small staging buffer otherwise
(prefixes and headers), so each byte is copied once, by the kernel. A payload is sent in chunks, each
handed to the kernel before the next (the transport's write buffer limit is 0), so `send` returns with
every byte in the kernel and the caller may reuse the tensor. CUDA payloads are staged through pinned host
memory both ways (`framing.host_copy`; D receives into pinned memory when its KV is on a GPU), which copies
several times faster than pageable memory. (asyncio's StreamReader moved 0.23 GiB/s on the CI VM, where the
socket itself moves 0.8-1.1: docs/benchmarks.md, KV transfer.)

Invariants: one reader and one writer at a time per channel (framing's receive loop and its send lock);
bytes nobody asked for yet are held up to `_PAUSE_AT`, then the socket is not read until they are taken;
after `abort()` or the peer's close, every pending and later call raises `ConnectionLost`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import torch
from pdserve.kvtransfer.channel_connector import ChannelConnector
from pdserve.kvtransfer.common import ConnectionLost
from pdserve.kvtransfer.doorbell import Doorbell
from pdserve.kvtransfer.framing import ByteChannel, host_copy

_STAGING = 256 << 10  # what one socket read may fill while no payload is being read
_PAUSE_AT = 4 << 20  # unread bytes held before the socket is left unread
_WRITE_CHUNK = 2 << 20  # payload bytes handed to the transport at once
log = logging.getLogger("pdserve.kvtransfer")


class _Stream(asyncio.BufferedProtocol):
    """One connection's bytes, both ways. `heard_at` notes when bytes arrive from the socket, before anyone
    reads them: a peer is heard even while this end's reader is busy elsewhere."""

    def __init__(self, on_open: Callable[[_Stream], None] | None = None) -> None:
        self.heard_at = time.monotonic()
        self.transport: asyncio.Transport | None = None
        self.lost: str | None = None  # why the connection ended
        self._on_open = on_open
        self._staging = memoryview(bytearray(_STAGING))
        self._pending = bytearray()  # received, not yet read
        self._target: memoryview | None = None  # the payload being received into, while it is
        self._filled = 0
        self._wanted = 0  # the pending bytes the reader waits for
        self._read_paused = False
        self._write_paused = False
        self._waiters: list[asyncio.Future[None]] = []

    # the transport's side
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=0)  # pause_writing whenever the transport holds any byte
        if self._on_open is not None:
            self._on_open(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._staging if self._target is None else self._target[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self.heard_at = time.monotonic()
        if self._target is not None:
            self._filled += nbytes
            if self._filled == len(self._target):
                self._target = None  # never hand the socket an empty buffer
                self._wake()
            return
        self._pending += self._staging[:nbytes]
        if len(self._pending) >= _PAUSE_AT and not self._read_paused and self.transport is not None:
            self.transport.pause_reading()
            self._read_paused = True
        if len(self._pending) >= self._wanted:
            self._wake()

    def eof_received(self) -> bool:
        self.lost = self.lost or "closed by the peer"
        self._wake()
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = self.lost or (repr(exc) if exc else "closed")
        self._write_paused = False
        self._wake()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake()

    # the channel's side
    async def read_exact(self, nbytes: int) -> bytes:
        while len(self._pending) < nbytes:
            if self.lost is not None:
                raise ConnectionLost(f"{self.lost} with {len(self._pending)} of {nbytes} B read")
            self._wanted = nbytes
            await self._wait()
        self._wanted = 0
        data = bytes(self._pending[:nbytes])
        del self._pending[:nbytes]
        self._read_more()
        return data

    async def read_into(self, view: memoryview) -> None:
        take = min(len(self._pending), len(view))
        view[:take] = self._pending[:take]
        del self._pending[:take]
        if take < len(view):
            self._target, self._filled = view, take
            self._read_more()
            try:
                while self._target is not None:
                    if self.lost is not None:
                        raise ConnectionLost(f"{self.lost} after {self._filled} of {len(view)} B")
                    await self._wait()
            finally:
                self._target = None
        self._read_more()

    async def write(self, data: bytes | memoryview) -> None:
        for start in range(0, len(data), _WRITE_CHUNK):
            if self.lost is not None or self.transport is None or self.transport.is_closing():
                raise ConnectionLost(self.lost or "closed")
            self.transport.write(data[start : start + _WRITE_CHUNK])
            while self._write_paused:
                await self._wait()
        if self.lost is not None:
            raise ConnectionLost(self.lost)

    def _read_more(self) -> None:
        if self._read_paused and len(self._pending) < _PAUSE_AT and self.transport is not None:
            self._read_paused = False
            self.transport.resume_reading()

    async def _wait(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)

    def _wake(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)


class TcpChannel(ByteChannel):
    host_payloads: bool = True

    def __init__(self, stream: _Stream, pin: bool = False) -> None:
        """pin: receive payloads into pinned host memory (the node's KV lives on a GPU)."""
        assert stream.transport is not None
        self._stream = stream
        self._transport = stream.transport
        host, port = self._transport.get_extra_info("peername")[:2]
        self._peer = f"{host}:{port}"
        self._pin = pin

    @property
    def heard_at(self) -> float:
        return self._stream.heard_at

    @property
    def peer(self) -> str:
        return self._peer

    async def send(self, prefix: bytes, header: bytes, payload: torch.Tensor | None) -> None:
        try:
            await self._stream.write(prefix + header)
            if payload is not None:
                await self._stream.write(host_copy(payload).numpy().data)
        except ConnectionLost as e:
            raise ConnectionLost(f"send to {self._peer} failed: {e}") from e

    async def recv_exact(self, nbytes: int) -> bytes:
        try:
            return await self._stream.read_exact(nbytes)
        except ConnectionLost as e:
            raise ConnectionLost(f"connection from {self._peer} closed: {e}") from e

    async def recv_payload(self, nbytes: int) -> torch.Tensor:
        out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)
        try:
            await self._stream.read_into(out.numpy().data)
        except ConnectionLost as e:
            raise ConnectionLost(f"connection from {self._peer} failed: {e}") from e
        return out

    async def authenticated(self) -> None:
        return None

    @property
    def closed(self) -> bool:
        """The connection is gone (the peer hung up or it was aborted): nothing more will arrive."""
        return self._stream.lost is not None or self._transport.is_closing()

    def abort(self) -> None:
        self._stream.lost = self._stream.lost or "aborted"
        self._transport.abort()

    async def close(self) -> None:
        self._transport.close()


class TcpListener:
    def __init__(self, server: asyncio.Server) -> None:
        self._server = server

    @property
    def port(self) -> int:
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        self._server.close()
        await self._server.wait_closed()


class TcpTransport:
    scheme = "tcp"

    def __init__(self, device: str = "cpu") -> None:
        self._pin = torch.device(device).type == "cuda"  # D's GPU copies each payload from host memory

    async def dial(self, host: str, port: int, timeout_s: float) -> ByteChannel:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                _, stream = await loop.create_connection(_Stream, host, port)
        except (TimeoutError, OSError) as e:
            raise ConnectionLost(f"cannot connect to tcp://{host}:{port}: {e!r}") from e
        return TcpChannel(stream, self._pin)

    async def listen(
        self, host: str, port: int, on_channel: Callable[[ByteChannel], Awaitable[None]]
    ) -> TcpListener:
        tasks: set[asyncio.Task[None]] = set()

        def accepted(stream: _Stream) -> None:
            channel = TcpChannel(stream, self._pin)
            task = asyncio.ensure_future(on_channel(channel))
            tasks.add(task)
            task.add_done_callback(lambda t: ended(t, channel))

        def ended(task: asyncio.Task[None], channel: TcpChannel) -> None:
            tasks.discard(task)
            error = None if task.cancelled() else task.exception()
            if error is not None:  # the handler failed: its connection is cut, not left open
                log.error("KV-transfer connection handler for %s failed", channel.peer, exc_info=error)
                channel.abort()

        def protocol() -> _Stream:
            return _Stream(accepted)

        return TcpListener(await asyncio.get_running_loop().create_server(protocol, host, port))


class ControlChannel(ByteChannel):
    """The base of the channels that carry frames on a TCP control connection and payloads another way
    (nccl's pair group, cuda_ipc's window, ucx's endpoint): the control connection gives the peer, liveness
    and the frames' prefix and header; `_dead` (why the channel is closed) fails every later call; a channel
    whose ends share a host sets `_doorbell` to take ACKs from it."""

    name = "control"  # the connector, in errors

    def __init__(self, control: TcpChannel) -> None:
        self._control = control
        self._dead: str | None = None
        self._doorbell: Doorbell | None = None

    @property
    def peer(self) -> str:
        return self._control.peer

    @property
    def heard_at(self) -> float:
        return self._control.heard_at

    def _check(self) -> None:
        if self._dead is not None:
            raise ConnectionLost(f"{self.name} channel to {self.peer} is closed: {self._dead}")

    async def recv_exact(self, nbytes: int) -> bytes:
        self._check()
        return await self._control.recv_exact(nbytes)

    def ring_ack(self, key: bytes) -> None:
        if self._doorbell is not None:
            self._doorbell.ring(key)

    def ack_rung(self, key: bytes) -> bool:
        return self._doorbell is not None and self._doorbell.rung(key)


class ControlTransport:
    """Dials and listens like the TCP transport, each connection then wrapped in a channel that carries
    payloads another way (nccl's pair group, cuda_ipc's window): `wrap(control, rank, host)`, rank 1 on the
    dialing end (P), 0 on the accepting end (D), host the one dialed or listened on."""

    def __init__(self, scheme: str, wrap: Callable[[TcpChannel, int, str], ByteChannel]) -> None:
        self.scheme = scheme
        self._wrap = wrap
        self._tcp = TcpTransport()

    async def dial(self, host: str, port: int, timeout_s: float) -> ByteChannel:
        control = await self._tcp.dial(host, port, timeout_s)
        assert isinstance(control, TcpChannel)
        return self._wrap(control, 1, host)

    async def listen(
        self, host: str, port: int, on_channel: Callable[[ByteChannel], Awaitable[None]]
    ) -> TcpListener:
        async def accept(control: ByteChannel) -> None:
            assert isinstance(control, TcpChannel)
            await on_channel(self._wrap(control, 0, host))

        return await self._tcp.listen(host, port, accept)


CONNECTOR = ChannelConnector(lambda config: TcpTransport(config.device), checksum_default=True)
