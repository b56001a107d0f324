"""The UCX connector (ucxx): the same frames, each part one tagged UCX message, payloads as raw buffers.

Host payloads go over UCX's TCP/shared-memory transports. A CUDA payload is sent as device memory (ucxx
takes `__cuda_array_interface__` objects): cuda_ipc within a host, RDMA across hosts. With a CUDA
`ConnectorConfig.device`, D receives into one device buffer per connection, grown to the largest frame and
reused (the previous frame's consumers, queued on the current stream, finish before it is overwritten).
ucxx listens on every interface; the address names `listen_host`. Invariant: after `abort()` (or any UCX
error) every pending and later call raises `ConnectionLost`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import numpy as np
import torch
import ucxx
from pdserve.kvtransfer.channel_connector import ChannelConnector
from pdserve.kvtransfer.common import ConnectionLost
from pdserve.kvtransfer.connector import ConnectorConfig
from pdserve.kvtransfer.device_sync import stream_idle
from pdserve.kvtransfer.framing import ByteChannel

_UCX_ERRORS = (ucxx.exceptions.UCXError, ucxx.exceptions.UCXCanceled)


class UcxChannel:
    def __init__(self, endpoint: ucxx.Endpoint, peer: str, device: torch.device) -> None:
        self._ep = endpoint
        self._peer = peer
        self._closed = False
        self._device = device
        self._buffer: torch.Tensor | None = None  # [capacity] uint8 on a CUDA device, reused per frame

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
            if payload is not None and payload.numel() > 0:
                await self._ep.send(payload if payload.is_cuda else payload.numpy())
        except _UCX_ERRORS as e:
            self._closed = True
            raise ConnectionLost(f"UCX send to {self._peer} failed: {e!r}") from e

    async def authenticated(self) -> None:
        return None

    async def _recv_into(self, array: np.ndarray | torch.Tensor) -> None:
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
        if self._device.type == "cpu":
            out = torch.empty(nbytes, dtype=torch.uint8)
            await self._recv_into(out.numpy())
            return out
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        # UCX writes on its own streams: kernels still reading the previous frame must be done first.
        await stream_idle(torch.cuda.current_stream(self._device))
        view = self._buffer[:nbytes]
        await self._recv_into(view)
        return view

    def abort(self) -> None:
        self._closed = True
        self._buffer = None
        self._ep.abort()

    async def close(self) -> None:
        self._closed = True
        self._buffer = None
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

    def __init__(self, device: str = "cpu") -> None:
        self.device = torch.device(device)

    def _bind_device(self) -> None:
        """UCX's CUDA transports work in the current CUDA context: make it this node's GPU's."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    async def dial(self, host: str, port: int, timeout_s: float) -> ByteChannel:
        self._bind_device()
        try:
            endpoint = await ucxx.create_endpoint(host, port, connect_timeout=timeout_s)
        except (*_UCX_ERRORS, TimeoutError, OSError) as e:
            raise ConnectionLost(f"cannot connect to ucx://{host}:{port}: {e!r}") from e
        return UcxChannel(endpoint, f"{host}:{port}", self.device)

    async def listen(
        self, host: str, port: int, on_channel: Callable[[ByteChannel], Awaitable[None]]
    ) -> UcxListener:
        self._bind_device()

        async def accept(endpoint: ucxx.Endpoint) -> None:
            await on_channel(UcxChannel(endpoint, f"ucx-endpoint-{endpoint.uid:#x}", self.device))

        return UcxListener(ucxx.create_listener(accept, port=port))


def _checksum_default(config: ConnectorConfig) -> bool:
    """On over host memory (TCP, shared memory); off when payloads are GPU memory (cuda_ipc over NVLink,
    RDMA), whose links check integrity, and where a CRC would copy each payload to the host first."""
    return torch.device(config.device).type != "cuda"


CONNECTOR = ChannelConnector(lambda config: UcxTransport(config.device), checksum_default=_checksum_default)
