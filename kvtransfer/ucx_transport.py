"""The UCX connector's transport (ucxx): frames over a TCP control connection, DATA payloads over a UCX
endpoint. The connector (ucx.py: its options, its checksum default) imports this module when a ucx end is
built, so a configuration naming ucx is read and checked without ucxx installed.

Each connection is the TCP connector's connection, which carries every frame's prefix and header, plus one
UCX endpoint that carries only payloads, as tagged messages in frame order (host memory over UCX's
TCP/shared-memory transports; CUDA memory over cuda_ipc within a host, RDMA across hosts). Payloads land on
`ConnectorConfig.device`. The setup record, the standing receive and why the frames stay on TCP are in
docs/kv_transfer_protocol.md ("ucx"), the measurements behind them in its "Measurements" section.

Standing receive: D keeps one receive posted ahead into its slot (`UcxOptions.window_bytes`); P sends
payloads that fit D's window with tag WINDOW, larger ones with tag LATE, for which D posts a receive of the
exact size at the payload's prefix. The slot's next receive is posted once the caller released the payload
in it, the previous receive ended and, on a GPU, the consumers queued on the caller's stream finished. P
posts each payload as a UCX send before writing its prefix (host payloads at most MAX_IN_FLIGHT per
connection, GPU payloads one at a time). On a GPU, D returns the payload's view at once and
`payload_landed()` is False until `landed()` saw the receive end; host payloads are whole on return.

Invariants: D has at most one WINDOW receive and one LATE receive posted, and a receive is posted into a
buffer only after the previous one into it ended and its consumers finished; P's payloads with tag WINDOW
never exceed D's window; after `abort()` (or any UCX error, a payload still in flight included) every
pending and later call raises `ConnectionLost`; a payload's tensor stays referenced until UCX is done with
its request, also after `abort()`; `close()` returns with no request of the channel left; every request is
awaited through `ucx_request` (ucx_context.py).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import struct
import time
from collections.abc import Awaitable, Callable

import numpy as np
import torch
import ucxx
from pdserve.kvtransfer.common import ConnectionLost
from pdserve.kvtransfer.connector import ConnectorConfig
from pdserve.kvtransfer.device_sync import SPIN_S, event_done, stream_idle
from pdserve.kvtransfer.framing import ByteChannel
from pdserve.kvtransfer.tcp import ControlChannel, ControlTransport, TcpChannel, TcpListener
from pdserve.kvtransfer.ucx import UcxOptions
from pdserve.kvtransfer.ucx_context import (
    CONTEXT,
    ORPHANS,
    UCX_ERRORS,
    RequestFailed,
    progress_mode,
    settle,
    ucx_request,
)

log = logging.getLogger("pdserve.kvtransfer")
RECORD = struct.Struct("<4sH2xQ16s")  # magic, UCX listener port, pad, D's window, key
RECORD_MAGIC = b"PDUX"
KEY_BYTES = 16
WINDOW, LATE = 1, 2  # payload tags: fits D's window (its standing receive), larger (posted at the prefix)
MAX_IN_FLIGHT = 8  # host payload sends posted ahead of their completion, per connection


class UcxChannel(ControlChannel):
    name = "UCX"

    def __init__(self, control: TcpChannel, rank: int, host: str, transport: UcxTransport) -> None:
        super().__init__(control)
        self._rank = rank  # 1 on P (it dialed), 0 on D
        self._host = host  # where P reaches D's UCX listener: the host it dialed
        self._transport = transport
        self._device = transport.device
        self._ep: ucxx.Endpoint | None = None
        self._window = transport.window_bytes  # D: payloads up to this size land in the slot
        self._peer_window = 0  # P: D's window, from its record
        self._slot: torch.Tensor | None = None  # D: [window] uint8, where the standing receive writes
        self._standing: asyncio.Future[None] | None = None  # D: the slot's receive, posted ahead
        self._held: asyncio.Future[None] | None = None  # D: the slot's receive whose payload the caller has
        self._reposting: asyncio.Future[None] | None = None  # D: posts the next standing receive
        self._buffer: torch.Tensor | None = None  # D: LATE payloads on a GPU, grown to the largest, reused
        self._in_flight: collections.deque[asyncio.Future[None]] = collections.deque()  # P's payload sends
        self._landing: asyncio.Future[None] | None = None  # D: the last payload's receive, until seen landed
        self._context: int | None = None  # as a user of CONTEXT (its generation), from setup to the end
        self._closing = False  # close() lets go of CONTEXT itself, once its requests ended

    def _lost(self, reason: str) -> ConnectionLost:
        """Tear the channel down for `reason`; the error to raise."""
        self._fail(reason)
        return ConnectionLost(f"UCX channel to {self.peer} failed: {reason}")

    def _endpoint(self) -> ucxx.Endpoint:
        self._check()
        assert self._ep is not None, "payload before the UCX endpoint was set up"
        return self._ep

    async def authenticated(self) -> None:
        self._check()
        timeout = self._transport.setup_timeout_s
        self._context = await CONTEXT.acquire(self._transport.progress_mode)
        try:
            if self._rank == 0:
                key = os.urandom(KEY_BYTES)
                endpoint = self._transport.expect(key)
                try:
                    await self._control.send(
                        RECORD.pack(RECORD_MAGIC, self._transport.ucx_port, self._window, key), b"", None
                    )
                    async with asyncio.timeout(timeout):
                        self._ep = await endpoint
                finally:
                    self._transport.forget(key)
                self._slot = torch.empty(self._window, dtype=torch.uint8, device=self._device)
                self._post_standing()
                return
            magic, port, self._peer_window, key = RECORD.unpack(await self._control.recv_exact(RECORD.size))
            if magic != RECORD_MAGIC:
                raise ConnectionLost(f"{self.peer} sent {magic!r} instead of the {RECORD_MAGIC!r} record")
            self._transport.bind_device()
            self._ep = await ucxx.create_endpoint(self._host, port, connect_timeout=timeout)
            async with asyncio.timeout(timeout):
                await ucx_request(self._ep.send(np.frombuffer(key, dtype=np.uint8)))
        except (*UCX_ERRORS, RequestFailed, TimeoutError, OSError) as e:
            raise self._lost(f"UCX endpoint setup failed: {e!r}") from e
        except BaseException as e:
            self._fail(f"UCX endpoint setup failed: {e!r}")
            raise

    def _payload_done(self, future: asyncio.Future[None]) -> None:
        """A payload request failed in flight: the frame is cut, so is the connection."""
        if not future.cancelled() and future.exception() is not None:
            self._fail(f"a payload failed: {future.exception()!r}")

    async def send(self, prefix: bytes, header: bytes, payload: torch.Tensor | None) -> None:
        self._check()
        body = payload if payload is not None and payload.numel() > 0 else None
        endpoint = None if body is None else self._endpoint()  # handshake frames come before the endpoint
        try:
            if body is not None and endpoint is not None:
                if body.is_cuda:
                    while self._in_flight:  # GPU payloads one at a time
                        await self._in_flight.popleft()
                tag = WINDOW if body.numel() <= self._peer_window else LATE
                big = asyncio.ensure_future(
                    ucx_request(endpoint.send(body if body.is_cuda else body.numpy(), tag=tag))
                )
                big.add_done_callback(self._payload_done)
                self._in_flight.append(big)
                await asyncio.sleep(0)  # posted now: a WINDOW payload moves before D reads its prefix
            await self._control.send(prefix, header, None)
            while self._in_flight and (self._in_flight[0].done() or len(self._in_flight) > MAX_IN_FLIGHT):
                await self._in_flight.popleft()
        except RequestFailed as e:
            raise self._lost(f"a payload send failed: {e}") from None
        except ConnectionLost as e:
            self._fail(f"control send failed: {e}")
            raise
        self._check()

    def _post_standing(self) -> None:
        """Post the slot's receive for the next payload that fits the window."""
        assert self._slot is not None and self._standing is None
        slot = self._slot if self._slot.is_cuda else self._slot.numpy()
        self._standing = asyncio.ensure_future(ucx_request(self._endpoint().recv(slot, tag=WINDOW)))

    async def _repost(self, held: asyncio.Future[None], consumers: torch.cuda.Event | None) -> None:
        """Post the next standing receive once `held` (the slot's last receive) ended and, on a GPU, the GPU
        passed `consumers`; its failure is reported by `landed`, or the channel is dead already."""
        if not held.done():
            await asyncio.wait([held])
        if consumers is not None:
            await event_done(consumers)
        if self._dead is None and not (held.cancelled() or held.exception() is not None):
            self._post_standing()

    def release_payload(self) -> None:
        """The caller is done with the slot's payload (its consumers are queued on its current stream): the
        next standing receive may be posted once they finished. A no-op when the slot holds nothing."""
        held, self._held = self._held, None
        if held is None or self._dead is not None:
            return
        consumers = None
        if self._device.type == "cuda":
            consumers = torch.cuda.Event()
            consumers.record(torch.cuda.current_stream(self._device))
        self._reposting = asyncio.ensure_future(self._repost(held, consumers))

    async def recv_payload(self, nbytes: int) -> torch.Tensor:
        endpoint = self._endpoint()
        self.release_payload()  # the previous payload is the caller's no longer
        await self.landed()  # the previous receive may still be writing into its buffer
        if nbytes <= self._window:
            if self._reposting is not None:
                await asyncio.wait([self._reposting])  # an abort cancels it: then _check raises
                self._reposting = None
            self._check()
            assert self._slot is not None and self._standing is not None, "no standing receive posted"
            self._landing = self._held = self._standing
            self._standing = None
            if self._device.type == "cpu":
                await self.landed()
            return self._slot[:nbytes]
        if self._device.type == "cpu":
            out = torch.empty(nbytes, dtype=torch.uint8)
            self._landing = asyncio.ensure_future(ucx_request(endpoint.recv(out.numpy(), tag=LATE)))
            await self.landed()
            return out
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        # UCX writes on its own streams: kernels still reading the previous frame must be done first.
        await stream_idle(torch.cuda.current_stream(self._device))
        view = self._buffer[:nbytes]
        self._landing = asyncio.ensure_future(ucx_request(endpoint.recv(view, tag=LATE)))
        await asyncio.sleep(0)  # posted now: the bytes move while the caller reads the header
        return view

    def payload_landed(self) -> bool:
        return self._landing is None  # a GPU payload is seen landed by `landed` only

    async def landed(self) -> None:
        """Return once the payload `recv_payload` returned last has arrived; ConnectionLost if it failed,
        the channel died, or it took longer than the liveness window (`liveness_s`)."""
        landing = self._landing
        if landing is None:
            self._check()
            return
        try:
            # A caller waits for these bytes: on a GPU, watch for them on every turn, briefly. Not on host
            # memory: the notifier thread that sets the future needs the GIL the turning loop holds (docs).
            if not landing.done() and self._device.type == "cuda":
                spin_until = time.perf_counter() + SPIN_S
                while not landing.done() and time.perf_counter() < spin_until:
                    await asyncio.sleep(0)
            if not landing.done():
                async with asyncio.timeout(self._transport.liveness_s):
                    await asyncio.shield(landing)
            landing.result()
        except TimeoutError:
            raise self._lost(f"payload not done within {self._transport.liveness_s}s") from None
        except RequestFailed as e:
            raise self._lost(f"a payload receive failed: {e}") from None
        self._landing = None
        self._check()

    async def flush(self) -> None:
        await self.landed()

    def _fail(self, reason: str) -> None:
        if self._dead is None:
            self._dead = reason
        self._control.abort()
        if self._ep is not None:
            self._ep.abort()
        # The aborted endpoint fails their requests soon; until then UCX may still use their tensors, so
        # they stay referenced (not cancelled) until they finish.
        for future in self._take_requests():
            assert self._context is not None, "payload requests before the UCX setup"
            CONTEXT.retain(self._context)  # until it finished: its completion comes through the notifier
            if future.done():
                settle(self._context, future)
            else:
                ORPHANS.add(future)
                future.add_done_callback(functools.partial(settle, self._context))
        if not self._closing:
            self._release_context()

    def _release_context(self) -> None:
        if self._context is not None:
            CONTEXT.release(self._context)
            self._context = None

    def _take_requests(self) -> list[asyncio.Future[None]]:
        """The channel's payload requests still held (sends, then receives), now the caller's; the receive
        buffers are dropped with them (a request in flight keeps its own view of its buffer)."""
        if self._reposting is not None:  # dead already: it would post nothing
            self._reposting.cancel()
        receives = (self._landing, self._held, self._standing)
        taken = [*self._in_flight, *dict.fromkeys(r for r in receives if r is not None)]
        self._in_flight.clear()
        self._landing = self._held = self._standing = self._reposting = None
        self._buffer = self._slot = None
        return taken

    def abort(self) -> None:
        self._fail("connection aborted")

    async def close(self) -> None:
        if self._dead is None:
            self._dead = "closed"
        self._closing = True
        pending = self._take_requests()
        if self._ep is not None:
            await self._ep.close()  # ends the requests still in flight; then they can be collected
        await asyncio.gather(*pending, return_exceptions=True)
        self._release_context()
        await self._control.close()


class UcxListener:
    def __init__(self, control: TcpListener, transport: UcxTransport) -> None:
        self._control = control
        self._transport = transport

    @property
    def port(self) -> int:
        return self._control.port

    async def close(self) -> None:
        await self._control.close()
        self._transport.close_listener()


class UcxTransport:
    """TCP control connections (a ControlTransport) with a UCX endpoint each; D's end runs the ucxx listener
    those endpoints connect to."""

    scheme = "ucx"

    def __init__(self, config: ConnectorConfig) -> None:
        self._control = ControlTransport(
            self.scheme, lambda control, rank, host: UcxChannel(control, rank, host, self)
        )
        self.device = torch.device(config.device)
        self.setup_timeout_s = config.handshake_timeout_s
        self.liveness_s = config.liveness_s
        self.window_bytes = config.options_of(UcxOptions).window_bytes
        self.progress_mode = progress_mode(config)
        self._listener: ucxx.Listener | None = None
        self._listener_context = 0  # the CONTEXT generation the listener joined
        self._expected: dict[bytes, asyncio.Future[ucxx.Endpoint]] = {}

    def bind_device(self) -> None:
        """UCX's CUDA transports work in the current CUDA context: make it this node's GPU's."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    @property
    def ucx_port(self) -> int:
        assert self._listener is not None, "D's UCX listener is not running"
        return int(self._listener.port)

    def expect(self, key: bytes) -> asyncio.Future[ucxx.Endpoint]:
        """The endpoint that will present `key`, once it connected."""
        future: asyncio.Future[ucxx.Endpoint] = asyncio.get_running_loop().create_future()
        self._expected[key] = future
        return future

    def forget(self, key: bytes) -> None:
        self._expected.pop(key, None)

    async def _accept(self, endpoint: ucxx.Endpoint) -> None:
        key = np.empty(KEY_BYTES, dtype=np.uint8)
        try:
            async with asyncio.timeout(self.setup_timeout_s):
                await ucx_request(endpoint.recv(key))
        except (RequestFailed, TimeoutError):
            endpoint.abort()
            return
        future = self._expected.pop(key.tobytes(), None)
        if future is None or future.done():
            endpoint.abort()
            return
        future.set_result(endpoint)

    async def dial(self, host: str, port: int, timeout_s: float) -> ByteChannel:
        self.bind_device()
        return await self._control.dial(host, port, timeout_s)

    async def listen(
        self, host: str, port: int, on_channel: Callable[[ByteChannel], Awaitable[None]]
    ) -> UcxListener:
        self.bind_device()
        assert self._listener is None, "one listener per transport"
        self._listener_context = await CONTEXT.acquire(self.progress_mode)
        try:
            self._listener = ucxx.create_listener(self._accept, port=0)
        except BaseException:
            CONTEXT.release(self._listener_context)
            raise
        try:
            control = await self._control.listen(host, port, on_channel)
        except BaseException:
            self.close_listener()
            raise
        return UcxListener(control, self)

    def close_listener(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            CONTEXT.release(self._listener_context)
