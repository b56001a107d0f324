"""The UCX connector (ucxx): the same frames, each part one tagged UCX message, payloads as raw buffers.

Over TCP/shared memory here (host tensors); ucxx also takes CUDA arrays, which is how a GPU variant will
receive into device memory. ucxx listens on every interface; the address names `listen_host`. Invariant:
after `abort()` (or any UCX error) every pending and later call raises `ConnectionLost`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import numpy as np
import torch
import ucxx
from pdserve.kvtransfer.channel_connector import ChannelConnector
from pdserve.kvtransfer.common import ConnectionLost
from pdserve.kvtransfer.framing import ByteChannel

_UCX_ERRORS = (ucxx.exceptions.UCXError, ucxx.exceptions.UCXCanceled)


class UcxChannel:
    def __init__(self, endpoint: ucxx.Endpoint, peer: str) -> None:
        self._ep = endpoint
        self._peer = peer
        self._closed = False

    @property
    def peer(self) -> str:
        return self._peer

    def _check(self) -> None:
        if self._closed:
            raise ConnectionLost(f"UCX endpoint to {self._peer} is closed")

    async def send(self, prefix: bytes, header: bytes, payload: torch.Tensor | None) -> None:
        self._check()
        if self._ep.closed:
            self._closed = True
            raise ConnectionLost(f"UCX endpoint to {self._peer} is closed")
        try:
            await self._ep.send(np.frombuffer(prefix, dtype=np.uint8))
            await self._ep.send(np.frombuffer(header, dtype=np.uint8))
            if payload is not None:
                await self._ep.send(payload.cpu().numpy())
        except _UCX_ERRORS as e:
            self._closed = True
            raise ConnectionLost(f"UCX send to {self._peer} failed: {e!r}") from e

    async def _recv_into(self, array: np.ndarray) -> None:
        self._check()  # a peer-closed endpoint may still deliver what already arrived: ucxx probes for it
        try:
            await self._ep.recv(array)
        except _UCX_ERRORS as e:
            self._closed = True
            raise ConnectionLost(f"UCX receive from {self._peer} failed: {e!r}") from e

    async def recv_exact(self, nbytes: int) -> bytes:
        buf = np.empty(nbytes, dtype=np.uint8)
        await self._recv_into(buf)
        return buf.tobytes()

    async def recv_payload(self, nbytes: int) -> torch.Tensor:
        out = torch.empty(nbytes, dtype=torch.uint8)
        await self._recv_into(out.numpy())
        return out

    def abort(self) -> None:
        self._closed = True
        self._ep.abort()

    async def close(self) -> None:
        self._closed = True
        await self._ep.close()


class UcxListener:
    def __init__(self, listener: ucxx.Listener) -> None:
        self._listener = listener

    @property
    def port(self) -> int:
        return int(self._listener.port)

    async def close(self) -> None:
        self._listener.close()


class UcxTransport:
    scheme = "ucx"

    async def dial(self, host: str, port: int, timeout_s: float) -> ByteChannel:
        try:
            endpoint = await ucxx.create_endpoint(host, port, connect_timeout=timeout_s)
        except (*_UCX_ERRORS, TimeoutError, OSError) as e:
            raise ConnectionLost(f"cannot connect to ucx://{host}:{port}: {e!r}") from e
        return UcxChannel(endpoint, f"{host}:{port}")

    async def listen(
        self, host: str, port: int, on_channel: Callable[[ByteChannel], Awaitable[None]]
    ) -> UcxListener:
        async def accept(endpoint: ucxx.Endpoint) -> None:
            await on_channel(UcxChannel(endpoint, f"ucx-endpoint-{endpoint.uid:#x}"))

        return UcxListener(ucxx.create_listener(accept, port=port))


CONNECTOR = ChannelConnector(UcxTransport())
