"""Control frames over TCP, payloads over a two-rank torch.distributed process group, one per connection.

The transport behind the nccl connector (nccl.py supplies the group). A connection is the TCP connection
of the TCP connector; every frame's prefix and header travel on it unchanged, and a DATA payload follows
on the pair's group (P `send`s, D `recv`s into one reused buffer on `ConnectorConfig.device`). Both ends
handle frames strictly in order, so the n-th payload send meets the n-th payload recv.

Setup, after the handshake authenticated the peer (`authenticated`), before any other frame: D hosts
a fresh TCPStore (port 0) and writes one 40-byte record on the TCP connection: magic `PDPG`, the store's
port (u16 LE), 2 pad bytes, 16 random bytes that prefix every store key of this pair, and the 16-byte token
of D's ACK doorbell file (doorbell.py; zeros when D could not make one). P maps that file if it is on this
host, connects to the store at the host it dialed; D is rank 0, P rank 1, world size 2; a 1-byte warm-up
payload P -> D makes the communicator exist before the first OPEN, and once it arrived D unlinks the file.
Teardown (`abort`/`close`, run when the connection ends, the peer dies, or a payload op fails or times
out) aborts the group and drops the store, the buffer and the doorbell.

Teardown runs the group's abort in a thread of its own: ncclCommAbort takes a good part of a second
(docs/kv_transfer_protocol.md, "Measurements"), and on the event loop it would stall every request the node
serves meanwhile. `live_groups` counts a group until its abort has returned, and `close` returns only then.

Pipelining: P's sends (and D's recvs on a GPU, ordered before D's consumers on the GPU itself) are posted
without waiting, at most MAX_IN_FLIGHT sends per connection; one reaper task polls them in order.
Invariants: a payload op is never left in flight on a live group: a wait that fails, times out
(`liveness_s`), is cancelled, or sees the control connection close aborts the whole channel, so a
cut send/recv raises `ConnectionLost` instead of hanging; a posted op's tensor stays referenced until the
op is seen done or the group is aborted; after `abort()` every call raises `ConnectionLost`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import mmap
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist
from pdserve.kvtransfer.common import ConnectionLost
from pdserve.kvtransfer.connector import ConnectorConfig
from pdserve.kvtransfer.device_sync import MAX_SLEEP_S, SPIN_S, on_device, on_stream
from pdserve.kvtransfer.doorbell import DOORBELL_BYTES, NAME_BYTES, Doorbell, SharedFile, open_shared
from pdserve.kvtransfer.tcp import ControlChannel, ControlTransport, TcpChannel

log = logging.getLogger("pdserve.kvtransfer")

RECORD = struct.Struct("<4sH2x16s16s")  # magic, store port, pad, key prefix, doorbell token
RECORD_MAGIC = b"PDPG"
MAX_IN_FLIGHT = 8  # payload sends posted ahead of their completion, per connection
DOORBELL_PREFIX = "pdserve-ack-"
NO_DOORBELL = "no ACK doorbell with %s (%s): ACKs take the control connection"
_LIVE: weakref.WeakSet[PairGroupChannel] = weakref.WeakSet()
_ABORTING: set[threading.Thread] = set()  # group aborts still running


class PairGroup(Protocol):
    """One pair's payload group: rank 0 is D, rank 1 is P."""

    def send(self, tensor: torch.Tensor) -> dist.Work: ...

    def recv(self, tensor: torch.Tensor) -> dist.Work:
        """On a GPU, the op starts after the work queued so far on `tensor`'s device's current stream
        (ProcessGroupNCCL orders every op after the current stream's work)."""

    def done(self, work: dist.Work) -> bool:
        """Whether `work` finished, without blocking; raises RuntimeError if it failed."""

    def order_after(self, work: dist.Work) -> None:
        """Make the calling thread's current stream wait, on the GPU, for `work` (no host wait). The op
        runs on the backend's own stream, not on the stream current when it was posted, so waiting for
        that stream would not wait for the op."""

    def abort(self) -> None:
        """Tear the group down now, pending ops included (the peer may be dead)."""


class GroupBackend(Protocol):
    name: str

    def connect(self, store: dist.Store, rank: int, device: torch.device, timeout_s: float) -> PairGroup:
        """Build the group (blocking: called in a worker thread); `timeout_s` bounds the watchdog of
        backends that have one, and must exceed the channel's own payload timeout."""


def live_groups() -> int:
    """Pair groups set up in this process or still being aborted (an audit: 0 once every connection closed
    and its teardown finished)."""
    return sum(1 for channel in _LIVE if channel.has_group) + len(_ABORTING)


def wait_aborted(timeout_s: float) -> None:
    """Block until every group abort started so far has returned, or `timeout_s` passed (for audits at
    shutdown; from asyncio, run it in a thread)."""
    deadline = time.monotonic() + timeout_s
    for thread in list(_ABORTING):
        thread.join(max(0.0, deadline - time.monotonic()))


class PairGroupChannel(ControlChannel):
    def __init__(
        self, control: TcpChannel, backend: GroupBackend, rank: int, host: str, config: ConnectorConfig
    ) -> None:
        super().__init__(control)
        self.name = backend.name
        self._backend = backend
        self._rank = rank
        self._host = host  # where P reaches D's store: the host it dialed
        self._device = torch.device(config.device)
        self._setup_timeout_s = config.handshake_timeout_s
        self._liveness_s = config.liveness_s
        self._store: dist.Store | None = None
        self._shared: SharedFile | None = None  # D: the doorbell's file, until P mapped it
        self._bell_mapping: mmap.mmap | None = None  # D's own mapping, or P's read-only one
        self._group: PairGroup | None = None
        self._buffer: torch.Tensor | None = None  # D: [capacity] uint8 on the device, reused per frame
        self._stream = torch.cuda.Stream(self._device) if self._device.type == "cuda" else None
        # Payload ops posted and not yet seen done, oldest first: (work, its tensor, posted at)
        self._in_flight: collections.deque[tuple[dist.Work, torch.Tensor, float]] = collections.deque()
        self._reaper: asyncio.Future[None] | None = None
        self._retired = asyncio.Event()  # set by the reaper each time it retires an op or stops
        self._waiting = 0  # callers waiting in _until_in_flight: the reaper polls fast while > 0
        self._hurry = asyncio.Event()  # set when a caller starts waiting: cuts the reaper's sleep short
        self._aborting: threading.Thread | None = None  # this channel's group abort, once torn down
        _LIVE.add(self)

    @property
    def has_group(self) -> bool:
        return self._group is not None

    async def authenticated(self) -> None:
        self._check()
        timeout = timedelta(seconds=self._setup_timeout_s)
        if self._rank == 0:
            store = await asyncio.to_thread(
                dist.TCPStore, self._host, 0, 2, True, timeout, wait_for_workers=False
            )
            key = os.urandom(16)
            try:
                self._shared = SharedFile(DOORBELL_PREFIX, DOORBELL_BYTES)
            except OSError as e:
                log.warning(NO_DOORBELL, self.peer, e)
            else:
                self._bell_mapping = self._shared.mapping
            token = self._shared.token if self._shared is not None else bytes(NAME_BYTES)
            await self._control.send(RECORD.pack(RECORD_MAGIC, store.port, key, token), b"", None)
        else:
            magic, port, key, token = RECORD.unpack(await self._control.recv_exact(RECORD.size))
            if magic != RECORD_MAGIC:
                raise ConnectionLost(f"{self.peer} sent {magic!r} instead of the {RECORD_MAGIC!r} record")
            if any(token):  # None when D is on another host
                try:
                    self._bell_mapping = open_shared(DOORBELL_PREFIX, token, DOORBELL_BYTES)
                except (OSError, ValueError) as e:  # e.g. D runs as another user: the ACK frame will do
                    log.warning(NO_DOORBELL, self.peer, e)
            store = await asyncio.to_thread(dist.TCPStore, self._host, port, 2, False, timeout)
        if self._bell_mapping is not None:
            self._doorbell = Doorbell(self._bell_mapping, 0)
        self._store = store
        group_timeout = self._liveness_s + self._setup_timeout_s + 60.0
        self._group = await asyncio.to_thread(
            self._backend.connect, dist.PrefixStore(key.hex(), store), self._rank, self._device, group_timeout
        )
        warm = torch.zeros(1, dtype=torch.uint8, device=self._device)
        # The first op creates the communicator (a blocking rendezvous through the store): in a thread.
        group = self._group
        try:
            work = await asyncio.to_thread(self._post, group, warm, self._rank == 1)
        except BaseException as e:
            self._fail(f"{type(e).__name__}: {e}")
            raise
        await self._wait(work, time.perf_counter(), lambda: True)
        if self._shared is not None:  # P mapped the doorbell before it sent the warm-up payload
            self._shared.unlink()
        log.info("%s payload group with %s ready (rank %d)", self._backend.name, self.peer, self._rank)

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        """Sends run on a private stream, so they wait for nothing the engine queued on the current one."""
        if self._stream is None:
            yield
            return
        with on_stream(self._stream):
            yield

    def _post(self, group: PairGroup, tensor: torch.Tensor, send: bool) -> dist.Work:
        """Queue one op. A send goes behind the private stream: its payload is complete already (the
        caller's contract), so it waits for nothing the engine queued. A recv is posted with the caller's
        stream current, so it starts after the work queued there so far, which may still read the buffer's
        previous frame. No stream switch and wait of our own: on just-woken cores they cost D tens of µs per
        frame between reading the frame and posting its recv (docs/kv_transfer_protocol.md)."""
        if not send:
            return group.recv(tensor)
        with self._on_stream():
            return group.send(tensor)

    async def _wait(self, work: dist.Work, posted: float, urgent: Callable[[], bool]) -> None:
        """Poll one posted op until it is done, watching the control connection and the time limit. While
        `urgent()` (a caller waits for the op), it polls on every turn of the loop, for up to SPIN_S in a
        row; otherwise, and after that, it sleeps up to MAX_SLEEP_S between checks, waking at once when
        `_hurry` is set. Spinning only for a waiting caller keeps an idle node's loop (and the GIL, which
        its engine thread needs) free while payloads stream in the background."""
        self._check()
        group = self._group
        assert group is not None, "payload before the pair group was set up"
        delay = 0.0
        spin_start: float | None = None  # when the current run of urgent polling began
        try:
            while self._dead is not None or not group.done(work):
                now = time.perf_counter()
                waited, hurried = now - posted, urgent()
                if not hurried:
                    spin_start = None
                if self._dead is not None:
                    problem = self._dead
                elif self._control.closed:
                    problem = "the control connection closed during a payload"
                elif waited > self._liveness_s:
                    problem = f"payload not done within {self._liveness_s}s"
                elif hurried and (spin_start is None or now - spin_start <= SPIN_S):
                    spin_start = now if spin_start is None else spin_start
                    delay = 0.0
                    await asyncio.sleep(0)
                    continue
                else:
                    delay = min(max(2 * delay, 1e-4), MAX_SLEEP_S)
                    self._hurry.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(delay):
                            await self._hurry.wait()
                    continue
                raise ConnectionLost(f"{self._backend.name} payload with {self.peer} failed: {problem}")
        except BaseException as e:  # a failed, timed-out or cancelled op: the pair cannot be trusted
            self._fail(f"{type(e).__name__}: {e}")
            if isinstance(e, RuntimeError):  # the backend reported the op failed
                raise ConnectionLost(f"{self._backend.name} payload with {self.peer} failed: {e}") from e
            raise

    def _track(self, work: dist.Work, tensor: torch.Tensor) -> None:
        """Keep an op in flight (and its tensor alive) until the reaper sees it done."""
        self._in_flight.append((work, tensor, time.perf_counter()))
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.ensure_future(self._reap())

    async def _reap(self) -> None:
        """The one poller of tracked ops (a backend may not allow two waits on one op): retires them
        oldest first (they complete in order); a failure tears the pair down."""
        try:
            with contextlib.suppress(ConnectionLost):
                while self._in_flight and self._dead is None:
                    work, _, posted = self._in_flight[0]
                    await self._wait(work, posted, lambda: self._waiting > 0)
                    self._in_flight.popleft()
                    self._retired.set()
        finally:
            if self._dead is not None:
                self._in_flight.clear()
            self._retired.set()

    async def _until_in_flight(self, limit: int) -> None:
        """Wait until at most `limit` tracked ops remain; ConnectionLost if the pair died meanwhile. The
        reaper polls fast while this waits."""
        self._check()
        if len(self._in_flight) <= limit:
            return
        self._waiting += 1
        self._hurry.set()
        try:
            while len(self._in_flight) > limit:
                self._check()
                self._retired.clear()
                await self._retired.wait()
        finally:
            self._waiting -= 1
        self._check()

    async def flush(self) -> None:
        await self._until_in_flight(0)

    async def send(self, prefix: bytes, header: bytes, payload: torch.Tensor | None) -> None:
        self._check()
        try:
            await self._control.send(prefix, header, None)
        except ConnectionLost as e:
            self._fail(f"control send failed: {e}")
            raise
        if payload is None or payload.numel() == 0:
            return
        if payload.device != self._device:  # e.g. a host buffer on a GPU link: stage it on the device
            payload = payload.to(self._device)
        assert self._group is not None, "payload before the pair group was set up"
        # Posted, not awaited: the next frame's send queues behind it on the pair's stream, so the link
        # never idles between frames. The tensor stays referenced until the op is seen done.
        self._track(self._post(self._group, payload, send=True), payload)
        await self._until_in_flight(MAX_IN_FLIGHT)

    async def recv_payload(self, nbytes: int) -> torch.Tensor:
        self._check()
        assert self._group is not None, "payload before the pair group was set up"
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        view = self._buffer[:nbytes]
        work = self._post(self._group, view, send=False)
        if self._stream is None:  # host memory: the bytes must be there before the caller reads them
            await self._wait(work, time.perf_counter(), lambda: True)
            return view
        # GPU: work the caller queues on its current stream from now on runs after the recv lands, so
        # the host does not wait per frame; `flush` (before COMPLETE is acknowledged) confirms it.
        with on_device(self._device):
            self._group.order_after(work)
        self._track(work, view)
        return view

    def _fail(self, reason: str, level: int = logging.WARNING) -> None:
        if self._dead is None:
            self._dead = reason
            log.log(level, "tearing down the %s pair with %s: %s", self._backend.name, self.peer, reason)
        self._control.abort()
        self._teardown()

    def _teardown(self) -> None:
        self._doorbell = None
        if self._shared is not None:
            self._shared.unlink()
            self._shared = None
        if self._bell_mapping is not None:
            self._bell_mapping.close()
            self._bell_mapping = None
        group, self._group, self._store, self._buffer = self._group, None, None, None
        self._in_flight.clear()  # the reaper, if running, sees the channel dead at its next check
        if group is not None:
            thread = threading.Thread(target=self._abort_group, args=(group,), name="pair-group-abort")
            _ABORTING.add(thread)
            self._aborting = thread
            thread.start()

    def _abort_group(self, group: PairGroup) -> None:
        try:
            group.abort()
        except RuntimeError as e:
            log.warning("aborting the %s group with %s failed: %s", self._backend.name, self.peer, e)
        finally:
            _ABORTING.discard(threading.current_thread())

    def abort(self) -> None:
        self._fail("connection aborted", logging.INFO)

    async def close(self) -> None:
        if self._dead is None:
            self._dead = "closed"
        self._teardown()
        if self._aborting is not None:  # the group is gone before the peer sees the connection close
            await asyncio.to_thread(self._aborting.join)
        await self._control.close()


class PairGroupTransport(ControlTransport):
    """Dials and listens like the TCP transport; each connection gets its own pair group."""

    def __init__(self, scheme: str, backend: GroupBackend, config: ConnectorConfig) -> None:
        super().__init__(
            scheme, lambda control, rank, host: PairGroupChannel(control, backend, rank, host, config)
        )
