"""The TCP connector: asyncio streams carrying length-prefixed protocol frames (host memory; the CPU default).

A frame's parts go out as two writes (prefix+header, then the payload's memory itself: no copy unless the
socket buffer is full), and a payload is read straight into a fresh uint8 tensor. CUDA payloads are staged
through host memory. Invariant: after `abort()` every pending and later call raises `ConnectionLost`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import SupportsIndex

import torch
from pdserve.kvtransfer.channel_connector import ChannelConnector
from pdserve.kvtransfer.common import ConnectionLost
from pdserve.kvtransfer.doorbell import Doorbell
from pdserve.kvtransfer.framing import ByteChannel

_READ_CHUNK = 4 << 20


class HeardReader(asyncio.StreamReader):
    """A StreamReader that notes when bytes arrive from the socket, before anyone reads them: a peer is heard
    even while this end's reader is busy elsewhere (a payload still landing, a frame being handled)."""

    def __init__(self) -> None:
        super().__init__()
        self.heard_at = time.monotonic()

    def feed_data(self, data: Iterable[SupportsIndex]) -> None:
        self.heard_at = time.monotonic()
        super().feed_data(data)


class TcpChannel(ByteChannel):
    def __init__(self, reader: HeardReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        host, port = writer.get_extra_info("peername")[:2]
        self._peer = f"{host}:{port}"

    @property
    def heard_at(self) -> float:
        return self._reader.heard_at

    @property
    def peer(self) -> str:
        return self._peer

    async def send(self, prefix: bytes, header: bytes, payload: torch.Tensor | None) -> None:
        if self._writer.is_closing():
            raise ConnectionLost(f"connection to {self._peer} is closed")
        try:
            self._writer.write(prefix + header)
            if payload is not None:
                self._writer.write(payload.cpu().numpy().data)
            await self._writer.drain()
        except (ConnectionError, OSError) as e:
            raise ConnectionLost(f"send to {self._peer} failed: {e}") from e

    async def recv_exact(self, nbytes: int) -> bytes:
        try:
            return await self._reader.readexactly(nbytes)
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            raise ConnectionLost(f"connection from {self._peer} closed: {e!r}") from e

    async def recv_payload(self, nbytes: int) -> torch.Tensor:
        out = torch.empty(nbytes, dtype=torch.uint8)
        view = out.numpy().data
        filled = 0
        while filled < nbytes:
            try:
                chunk = await self._reader.read(min(nbytes - filled, _READ_CHUNK))
            except (ConnectionError, OSError) as e:
                raise ConnectionLost(f"connection from {self._peer} failed: {e!r}") from e
            if not chunk:
                raise ConnectionLost(f"connection from {self._peer} closed after {filled} of {nbytes} B")
            view[filled : filled + len(chunk)] = chunk
            filled += len(chunk)
        return out

    async def authenticated(self) -> None:
        return None

    @property
    def closed(self) -> bool:
        """The connection is gone (the peer hung up or it was aborted): nothing more will arrive."""
        return self._writer.is_closing() or self._reader.at_eof()

    def abort(self) -> None:
        self._writer.transport.abort()

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self._writer.wait_closed()


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

    async def dial(self, host: str, port: int, timeout_s: float) -> ByteChannel:
        loop = asyncio.get_running_loop()
        reader = HeardReader()
        protocol = asyncio.StreamReaderProtocol(reader)
        try:
            async with asyncio.timeout(timeout_s):
                transport, _ = await loop.create_connection(lambda: protocol, host, port)
        except (TimeoutError, OSError) as e:
            raise ConnectionLost(f"cannot connect to tcp://{host}:{port}: {e!r}") from e
        return TcpChannel(reader, asyncio.StreamWriter(transport, protocol, reader, loop))

    async def listen(
        self, host: str, port: int, on_channel: Callable[[ByteChannel], Awaitable[None]]
    ) -> TcpListener:
        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            assert isinstance(reader, HeardReader)
            await on_channel(TcpChannel(reader, writer))

        def protocol() -> asyncio.StreamReaderProtocol:
            return asyncio.StreamReaderProtocol(HeardReader(), accept)

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


CONNECTOR = ChannelConnector(lambda config: TcpTransport(), checksum_default=True)
