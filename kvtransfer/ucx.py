"""The UCX connector (ucxx): the same frames, each part one tagged UCX message, payloads as raw buffers.

Host payloads go over UCX's TCP/shared-memory transports. A CUDA payload is sent as device memory (ucxx
takes `__cuda_array_interface__` objects): cuda_ipc within a host, RDMA across hosts. With a CUDA
`ConnectorConfig.device`, D receives into one device buffer per connection, grown to the largest frame and
reused (the previous frame's consumers, queued on the current stream, finish before it is overwritten).
ucxx listens on every interface; the address names `listen_host`.

Pipelining: `send` posts a frame's non-empty parts (prefix, header, payload) as UCX requests in order and
returns once the small parts are out; the payload's request stays in flight (it holds the tensor) while the
caller goes on, so a payload-first DATA's payload moves while P builds its header. Host payloads: at most
MAX_IN_FLIGHT per connection. GPU payloads: one at a time (a new one is posted once the previous finished;
eight in flight measured slower on two H200s, docs/benchmarks.md). A UCX endpoint matches messages of one
tag in the order they were posted, and asyncio starts tasks in the order they were created, so creating
every part's task before awaiting any keeps the wire order.
D still waits for each payload to land before it reads the next frame, so an ACK means every payload arrived.
Invariants: after `abort()` (or any UCX error, including a payload that failed in flight) every pending and
later call raises `ConnectionLost`; a payload's tensor stays referenced until UCX is done with its request,
also after `abort()`; `close()` returns with no request of the channel left.
"""

from __future__ import annotations

import asyncio
import collections
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
MAX_IN_FLIGHT = 8  # host payload sends posted ahead of their completion, per connection
_ORPHANS: set[asyncio.Future[None]] = set()  # payload sends of aborted channels, held until they finish


class UcxChannel:
    def __init__(self, endpoint: ucxx.Endpoint, peer: str, device: torch.device) -> None:
        self._ep = endpoint
        self._peer = peer
        self._closed = False
        self._device = device
        self._buffer: torch.Tensor | None = None  # [capacity] uint8 on a CUDA device, reused per frame
        self._in_flight: collections.deque[asyncio.Future[None]] = collections.deque()  # payload sends

    @property
    def peer(self) -> str:
        return self._peer

    def _check(self) -> None:
        if self._closed:
            raise ConnectionLost(f"UCX endpoint to {self._peer} is closed")

    def _lost(self, what: str, e: BaseException) -> ConnectionLost:
        self._closed = True
        return ConnectionLost(f"UCX {what} {self._peer} failed: {e!r}")

    def _payload_done(self, future: asyncio.Future[None]) -> None:
        """A payload send failed in flight: the frame is cut, so is the connection."""
        if not future.cancelled() and future.exception() is not None and not self._closed:
            self._closed = True
            self._ep.abort()

    async def send(self, prefix: bytes, header: bytes, payload: torch.Tensor | None) -> None:
        self._check()
        if self._ep.closed:
            self._closed = True
            raise ConnectionLost(f"UCX endpoint to {self._peer} is closed")
        parts = [np.frombuffer(part, dtype=np.uint8) for part in (prefix, header) if part]
        body = payload if payload is not None and payload.numel() > 0 else None
        try:
            if body is not None and body.is_cuda:
                while self._in_flight:  # GPU payloads one at a time
                    await self._in_flight.popleft()
            small = [asyncio.ensure_future(self._ep.send(part)) for part in parts]
            if body is not None:
                big = asyncio.ensure_future(self._ep.send(body if body.is_cuda else body.numpy()))
                big.add_done_callback(self._payload_done)
                self._in_flight.append(big)
            await asyncio.gather(*small)
            while self._in_flight and (self._in_flight[0].done() or len(self._in_flight) > MAX_IN_FLIGHT):
                await self._in_flight.popleft()
        except _UCX_ERRORS as e:
            raise self._lost("send to", e) from e
        self._check()

    async def authenticated(self) -> None:
        return None

    async def _recv_into(self, array: np.ndarray | torch.Tensor) -> None:
        self._check()  # a peer-closed endpoint may still deliver what already arrived: ucxx probes for it
        try:
            await self._ep.recv(array)
        except _UCX_ERRORS as e:
            raise self._lost("receive from", e) from e

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
        # The aborted endpoint fails their requests soon; until then UCX may still read their tensors, so
        # they stay referenced (not cancelled) until they finish.
        for future in self._in_flight:
            _ORPHANS.add(future)
            future.add_done_callback(_ORPHANS.discard)
        self._in_flight.clear()

    async def close(self) -> None:
        self._closed = True
        self._buffer = None
        await self._ep.close()  # ends the requests still in flight; then they can be collected
        pending, self._in_flight = list(self._in_flight), collections.deque()
        await asyncio.gather(*pending, return_exceptions=True)


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
