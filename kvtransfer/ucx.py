"""The UCX connector (ucxx): frames over a TCP control connection, DATA payloads over a UCX endpoint.

Each connection is the TCP connection of the TCP connector, which carries every frame's prefix and header,
plus one UCX endpoint that carries only payloads, as tagged messages in frame order. Host payloads go over
UCX's TCP/shared-memory transports. A CUDA payload is sent as device memory (ucxx takes
`__cuda_array_interface__` objects): cuda_ipc within a host, RDMA across hosts. Payloads land on
`ConnectorConfig.device` (GPU or host memory). Why not the frames themselves over UCX: each part was then
one UCX request, and every request an asyncio hop; after the payload, D read four such parts and wrote two
more before P saw its ACK (0.6 ms on two H200s, docs/benchmarks.md), where the TCP stream hands D every
frame that already arrived in one read.

Setup (`authenticated`, after the handshake, before any other frame): D's transport runs one ucxx
listener; D writes a 32-byte record on the TCP connection: magic `PDUX`, the listener's port (u16 LE), 2 pad
bytes, D's receive window in bytes (u64 LE), 16 random bytes. P opens a UCX endpoint to that port at the
host it dialed and sends the 16 bytes as its first message; D's listener hands the endpoint to the
connection that wrote them, and drops an endpoint whose bytes match none. Both ends give up after
`handshake_timeout_s`.

Standing receive: D keeps one receive posted ahead, before P sends anything, into a buffer of
`ConnectorConfig.window_bytes` (its "slot", allocated at setup), so a payload of up to that size starts
moving the moment P posts it, and D's reading of its prefix is off the payload's path. UCX matches a tagged
message to the receive posted first with its tag, whatever its size as long as it fits: P sends payloads
that fit D's window (the record says how large it is) with tag WINDOW, larger ones with tag LATE, and D posts
a LATE receive of the exact size when it reads such a payload's prefix. The slot's next receive is posted
once the caller released the payload in it (`release_payload`, as framing comes back for the next frame, or
the next `recv_payload`), the previous receive ended, and, on a GPU, the consumers the caller queued on its
current stream finished (UCX writes on its own streams, so D waits for them on the host, in a task).
Measured on two H200s: D posted its receive 255 µs after P's send began when it did so at the prefix.

Payloads: P posts each payload as a UCX send and then writes its prefix, and goes on (a payload-first
DATA's payload then moves while P builds its header): host payloads at most MAX_IN_FLIGHT per connection, GPU
payloads one at a time (a new one is posted once the previous finished; eight in flight measured slower on
two H200s). On a GPU, D returns the payload's view at once, so the receiver checks the header while the
bytes land; UCX cannot order GPU work after a receive, so the caller awaits `landed()` before the payload's
consumers run, and `flush()` before COMPLETE is acknowledged. Host payloads are received whole before
`recv_payload` returns (their checksum is computed at once).
Invariants: D has at most one WINDOW receive and one LATE receive posted, and a receive is posted into a
buffer only after the previous one into it ended and its consumers finished; P's payloads with tag WINDOW
never exceed D's window; after `abort()` (or any UCX error, a payload still in flight included) every
pending and later call raises `ConnectionLost`; a payload's tensor stays referenced until UCX is done with
its request, also after `abort()`; `close()` returns with no request of the channel left. Requests complete
through ucxx's Python futures (`_Context`), so no loop turns while a request waits (a GPU landing with a
caller waiting excepted, for SPIN_S), and each is awaited through `_request`, so no ucxx error that ucxx
keeps refers to a buffer.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import os
import struct
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import numpy as np
import torch
import ucxx
from pdserve.kvtransfer.channel_connector import ChannelConnector
from pdserve.kvtransfer.common import ConnectionLost
from pdserve.kvtransfer.connector import ConnectorConfig
from pdserve.kvtransfer.device_sync import SPIN_S, event_done, stream_idle
from pdserve.kvtransfer.framing import ByteChannel
from pdserve.kvtransfer.tcp import ControlTransport, TcpChannel, TcpListener

log = logging.getLogger("pdserve.kvtransfer")
_UCX_ERRORS = (ucxx.exceptions.UCXError, ucxx.exceptions.UCXCanceled)
RECORD = struct.Struct("<4sH2xQ16s")  # magic, UCX listener port, pad, D's window, key
RECORD_MAGIC = b"PDUX"
KEY_BYTES = 16
WINDOW, LATE = 1, 2  # payload tags: fits D's window (its standing receive), larger (posted at the prefix)
MAX_IN_FLIGHT = 8  # host payload sends posted ahead of their completion, per connection
_ORPHANS: set[asyncio.Future[None]] = set()  # payload requests of aborted channels, held until they finish


def progress_mode(config: ConnectorConfig) -> str:
    """The ucxx progress mode `config` asks for ("auto" resolved by its device)."""
    if config.ucx_progress != "auto":
        return config.ucx_progress
    return "thread-polling" if torch.device(config.device).type == "cuda" else "thread"


class _Context:
    """This process's UCX context, shared by every ucx transport (UCX has one per process; the first progress
    mode holds). Requests complete through ucxx's Python futures, which its notifier thread sets on the event
    loop: without them ucxx awaits a request by turning the loop without pause, so D's standing receive
    kept an idle node's loop busy for good, and a Python thread beside it (the node's engine) ran 4.4x
    slower (benchmarks/ucx_idle_loop.py). The notifier serves one event loop: it starts with the first user (a
    listener, a set-up channel, a request of an aborted channel still in flight) and stops, in a thread of
    its own (it takes up to a second), when the last one goes; the next loop (a test's) starts it anew."""

    def __init__(self) -> None:
        self.users = 0
        self.generation = 0  # counts starts: a user hands back the generation it joined
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopping: threading.Thread | None = None

    async def acquire(self, mode: str) -> int:
        """Become a user (starting the context on this loop if it has none); the generation to hand back."""
        loop = asyncio.get_running_loop()
        if self.users and loop is not self.loop:
            if self.loop is not None and not self.loop.is_closed():
                raise RuntimeError("ucx serves one event loop per process at a time")
            log.warning("%d UCX users of a closed event loop were never closed; starting afresh", self.users)
            self.users = 0
            self._stop()
        if self.users == 0:
            if self.stopping is not None:
                await asyncio.to_thread(self.stopping.join)
                self.stopping = None
            self._start(mode)
            self.loop = loop
            self.generation += 1
        self.users += 1
        return self.generation

    def retain(self, generation: int) -> None:
        """One more user, joining the `generation` an existing user holds."""
        if generation == self.generation and self.users:
            self.users += 1

    def release(self, generation: int) -> None:
        if generation != self.generation or not self.users:  # a user of a context started afresh since
            return
        self.users -= 1
        if not self.users:
            self._stop()

    def at_exit(self) -> None:
        """At interpreter exit, before it waits for threads: end the notifier if a user is left."""
        if self.users:
            self.users = 0
            self._stop()
        if self.stopping is not None:
            self.stopping.join()

    def _stop(self) -> None:
        self.loop = None
        self.stopping = threading.Thread(target=ucxx.stop_notifier_thread, name="ucx-notifier-stop")
        self.stopping.start()

    def _start(self, mode: str) -> None:
        try:
            ucxx.init(progress_mode=mode, enable_python_future=True)
        except RuntimeError:  # started by an earlier loop, whose users all went: restart its notifier here
            context = ucxx.core._get_ctx()
            if not context.enable_python_future:
                raise RuntimeError(
                    "ucxx was started without Python futures before the ucx connector"
                ) from None
            if context.progress_mode != mode:
                log.warning(
                    "UCX runs with progress mode %r already; %r is ignored", context.progress_mode, mode
                )
            context.start_notifier_thread()
        else:
            # a process that exits with users left (a crash path) must not wait on the notifier forever
            threading._register_atexit(CONTEXT.at_exit)  # type: ignore[attr-defined]


CONTEXT = _Context()


@contextlib.asynccontextmanager
async def ucx_context(config: ConnectorConfig) -> AsyncIterator[None]:
    """Hold this process's UCX context for raw ucxx use beside the connector (benchmarks)."""
    generation = await CONTEXT.acquire(progress_mode(config))
    try:
        yield
    finally:
        CONTEXT.release(generation)


class _RequestFailed(Exception):
    """A UCX request failed (cancelled by an endpoint's end, or an error); the message names ucxx's error."""


async def _request(op: Awaitable[object]) -> None:
    """Await one ucxx send or receive. ucxx keeps a failed request's exception for as long as the worker
    lives (in the Python future its C++ request set), and the traceback it gathers on the way up names every
    frame it passed, with their locals: the buffer among them (measured: each closed connection left its
    512 MiB slot allocated on D). So the error stops here, its traceback dropped, and a fresh one goes on."""
    try:
        await op
    except _UCX_ERRORS as e:
        e.__traceback__ = None
        raise _RequestFailed(repr(e)) from None


def _settle(generation: int, request: asyncio.Future[None]) -> None:
    """Let go of an aborted channel's request once it finished, reading its outcome (it failed, most likely:
    nobody waits for it any more, and asyncio would report the error as never retrieved)."""
    _ORPHANS.discard(request)
    CONTEXT.release(generation)
    if not request.cancelled():
        request.exception()


class UcxChannel:
    def __init__(self, control: TcpChannel, rank: int, host: str, transport: UcxTransport) -> None:
        self._control = control
        self._rank = rank  # 1 on P (it dialed), 0 on D
        self._host = host  # where P reaches D's UCX listener: the host it dialed
        self._transport = transport
        self._device = transport.device
        self._ep: ucxx.Endpoint | None = None
        self._dead: str | None = None
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

    @property
    def peer(self) -> str:
        return self._control.peer

    @property
    def heard_at(self) -> float:
        return self._control.heard_at

    def _check(self) -> None:
        if self._dead is not None:
            raise ConnectionLost(f"UCX channel to {self.peer} is closed: {self._dead}")

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
                    self._ep = await asyncio.wait_for(endpoint, timeout)
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
            await asyncio.wait_for(_request(self._ep.send(np.frombuffer(key, dtype=np.uint8))), timeout)
        except (*_UCX_ERRORS, _RequestFailed, TimeoutError, OSError) as e:
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
                    _request(endpoint.send(body if body.is_cuda else body.numpy(), tag=tag))
                )
                big.add_done_callback(self._payload_done)
                self._in_flight.append(big)
                await asyncio.sleep(0)  # posted now: a WINDOW payload moves before D reads its prefix
            await self._control.send(prefix, header, None)
            while self._in_flight and (self._in_flight[0].done() or len(self._in_flight) > MAX_IN_FLIGHT):
                await self._in_flight.popleft()
        except _RequestFailed as e:
            raise self._lost(f"a payload send failed: {e}") from None
        except ConnectionLost as e:
            self._fail(f"control send failed: {e}")
            raise
        self._check()

    async def recv_exact(self, nbytes: int) -> bytes:
        self._check()
        return await self._control.recv_exact(nbytes)

    def _post_standing(self) -> None:
        """Post the slot's receive for the next payload that fits the window."""
        assert self._slot is not None and self._standing is None
        slot = self._slot if self._slot.is_cuda else self._slot.numpy()
        self._standing = asyncio.ensure_future(_request(self._endpoint().recv(slot, tag=WINDOW)))

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
            self._landing = asyncio.ensure_future(_request(endpoint.recv(out.numpy(), tag=LATE)))
            await self.landed()
            return out
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        # UCX writes on its own streams: kernels still reading the previous frame must be done first.
        await stream_idle(torch.cuda.current_stream(self._device))
        view = self._buffer[:nbytes]
        self._landing = asyncio.ensure_future(_request(endpoint.recv(view, tag=LATE)))
        await asyncio.sleep(0)  # posted now: the bytes move while the caller reads the header
        return view

    async def landed(self) -> None:
        """Return once the payload `recv_payload` returned last has arrived; ConnectionLost if it failed,
        the channel died, or it took longer than the liveness window (`liveness_s`)."""
        landing = self._landing
        if landing is None:
            self._check()
            return
        try:
            # A caller waits for these bytes: on a GPU, watch for them on every turn, briefly (measured with
            # this on two H200s). Not on host memory: the notifier thread that sets the future needs the GIL
            # the turning loop holds (4 KiB frames took 712 against 592 us with it, 2-core CPU VM).
            if not landing.done() and self._device.type == "cuda":
                spin_until = time.perf_counter() + SPIN_S
                while not landing.done() and time.perf_counter() < spin_until:
                    await asyncio.sleep(0)
            if not landing.done():
                await asyncio.wait_for(asyncio.shield(landing), self._transport.liveness_s)
            landing.result()
        except TimeoutError:
            raise self._lost(f"payload not done within {self._transport.liveness_s}s") from None
        except _RequestFailed as e:
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
                _settle(self._context, future)
            else:
                _ORPHANS.add(future)
                future.add_done_callback(functools.partial(_settle, self._context))
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
        self.window_bytes = config.window_bytes
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
            await asyncio.wait_for(_request(endpoint.recv(key)), self.setup_timeout_s)
        except (_RequestFailed, TimeoutError):
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


def _checksum_default(config: ConnectorConfig) -> bool:
    """On over host memory (TCP, shared memory); off when payloads are GPU memory (cuda_ipc over NVLink,
    RDMA), whose links check integrity, and where a CRC would copy each payload to the host first."""
    return torch.device(config.device).type != "cuda"


CONNECTOR = ChannelConnector(UcxTransport, checksum_default=_checksum_default)
