"""The cuda_ipc connector: frames over TCP, DATA payloads copied by P straight into a window of D's GPU
memory through CUDA IPC (the copy engines, over NVLink between two GPUs of one host).

Why a push: a copy-engine copy moves a large payload GPU0 -> GPU1 faster than NCCL's send/recv
(docs/kv_transfer_protocol.md, "Measurements"), and it needs nothing posted by D first: P starts the copy as
soon as it has the payload, before it checks and encodes the frame's header (framing's payload-first DATA).
Both ends must run on one host; CUDA opens IPC memory of a GPU the process does not otherwise see, so
per-process CUDA_VISIBLE_DEVICES is fine.

Setup (`authenticated`, after the handshake; two records through the one codec, versioned with the
protocol): D exports its window (`CudaIpcOptions.window_bytes`), SLOTS interprocess "freed" events and a
shared-memory file (the progress counter and the ACK doorbell) in a `WindowOffer`; P maps them and answers
with SLOTS "copied" events in a `WindowAccept`.

Frames: payload k of a connection lands at an offset both ends compute alike (`WindowRing`), so no offset
travels. P waits on the host until D has released frame `must` (the newest earlier frame whose bytes the new
one overwrites, or frame k - SLOTS), makes its copy stream wait on the GPU for "freed"[must] (unless that
event has passed already), copies, records "copied"[k], then writes the frame. D, on the frame, makes its
current stream wait for "copied"[k] and hands out the window's view; when the caller comes back for the next
frame (framing's `release_payload`), the consumers it queued on that stream read the view, so D records
"freed"[k] after them and publishes k + 1 in the counter. Neither host waits for the GPU, except D's
`flush` (before it acknowledges COMPLETE), which polls the last "copied" event.

Invariants: payloads are copied and consumed in frame order on both ends; P never writes window bytes that
an unreleased frame still occupies (GPU-ordered through "freed"); an event slot is re-recorded only after D
published the frame SLOTS earlier, so no wait can name a record the other side has not made yet, and no GPU
wait cycle forms; D's window memory is not reused while P maps it (torch's IPC reference count keeps it
until P dropped the mapping, which P does only after its copies ended, and before its end of the connection
closes, so D frees the window as soon as it sees the connection end); after `abort()` every call raises
ConnectionLost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import struct
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from pdserve.kvtransfer.channel_connector import ChannelConnector
from pdserve.kvtransfer.common import ConnectionLost, ProtocolError
from pdserve.kvtransfer.connector import ConnectorConfig, ConnectorOptions
from pdserve.kvtransfer.cuda_ipc_setup import WindowAccept, WindowOffer, recv_record, send_record
from pdserve.kvtransfer.device_sync import on_device, on_stream, poll
from pdserve.kvtransfer.doorbell import DOORBELL_BYTES, Doorbell, SharedFile, open_shared
from pdserve.kvtransfer.tcp import ControlChannel, ControlTransport, TcpChannel
from pdserve.kvtransfer.window_ring import SLOTS, WindowRing

log = logging.getLogger("pdserve.kvtransfer")

SHM_PREFIX = "pdserve-ipc-"
COUNTER = struct.Struct("<q")
SHM_BYTES = COUNTER.size + DOORBELL_BYTES  # the progress counter, then the ACK doorbell
_LIVE: weakref.WeakSet[IpcChannel] = weakref.WeakSet()
_DROPPING: set[asyncio.Task[None]] = set()  # P mappings waiting for their copies to end


@dataclass(frozen=True)
class CudaIpcOptions(ConnectorOptions):
    """The cuda_ipc connector's own settings."""

    # D's window per connection on `ConnectorConfig.device`: it bounds one frame's payload (P splits larger
    # buffers by layers) and, with the frames in flight, how far P may run ahead of D.
    window_bytes: int = 512 << 20

    def __post_init__(self) -> None:
        if self.window_bytes <= 0:
            raise ValueError(f"CudaIpcOptions.window_bytes must be > 0, got {self.window_bytes}")


def live_windows() -> int:
    """Windows owned or mapped in this process, counting P's mappings that wait for their copies to end
    before they are dropped (an audit: 0 once every cuda_ipc connection closed)."""
    return sum(1 for channel in _LIVE if channel.has_window) + len(_DROPPING)


def _event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True)


def _handles(events: list[torch.cuda.Event]) -> tuple[bytes, ...]:
    return tuple(bytes(event.ipc_handle()) for event in events)


class IpcChannel(ControlChannel):
    name = "cuda_ipc"

    def __init__(self, control: TcpChannel, rank: int, config: ConnectorConfig) -> None:
        super().__init__(control)
        self._rank = rank  # 0: D (owns the window), 1: P (copies into it)
        self._device = torch.device(config.device)
        self._window_bytes = config.options_of(CudaIpcOptions).window_bytes
        self._liveness_s = config.liveness_s
        self._ring = WindowRing(self._window_bytes)
        self._window: torch.Tensor | None = None  # [window_bytes] uint8: D's own, or P's mapping of it
        self._freed: list[torch.cuda.Event] = []  # D records, P waits
        self._copied: list[torch.cuda.Event] = []  # P records, D waits
        self._counter: mmap.mmap | None = None  # frames D released so far (int64), then the doorbell
        self._shared: SharedFile | None = None  # D: the counter's file until P mapped it
        self._stream: torch.cuda.Stream | None = None  # P: the copy stream
        self._held: tuple[int, torch.cuda.Stream] | None = None  # D: payload handed out, its consumer stream
        self._last: int | None = None  # D: seq of the newest payload received
        _LIVE.add(self)

    @property
    def has_window(self) -> bool:
        return self._window is not None

    @property
    def payload_limit(self) -> int:
        return self._window_bytes

    async def authenticated(self) -> None:
        self._check()
        try:
            if self._rank == 0:
                await self._setup_receiver()
            else:
                await self._setup_sender()
        except BaseException as e:
            self._fail(f"setup failed: {type(e).__name__}: {e}")
            raise
        log.info("cuda_ipc window with %s ready (%d B, rank %d)", self.peer, self._window_bytes, self._rank)

    async def _setup_receiver(self) -> None:
        with on_device(self._device):
            torch.cuda.ipc_collect()  # windows of closed connections whose peer has let go by now
            self._window = torch.empty(self._window_bytes, dtype=torch.uint8, device=self._device)
            shared = self._window.untyped_storage()._share_cuda_()
            self._freed = [_event() for _ in range(SLOTS)]
            freed = _handles(self._freed)
        self._shared = SharedFile(SHM_PREFIX, SHM_BYTES)
        self._counter = self._shared.mapping
        self._doorbell = Doorbell(self._counter, COUNTER.size)
        _, handle, size, offset, rc_handle, rc_offset, event, event_sync = shared
        offer = WindowOffer(
            bytes(handle), int(size), int(offset), bytes(rc_handle), int(rc_offset), bytes(event or b""),
            bool(event_sync), freed, self._shared.token,
        )  # fmt: skip
        await send_record(self._control, offer)
        reply = await recv_record(self._control, WindowAccept)
        with on_device(self._device):
            self._copied = [torch.cuda.Event.from_ipc_handle(self._device, h) for h in reply.copied]
        self._unlink()

    async def _setup_sender(self) -> None:
        offer = await recv_record(self._control, WindowOffer)
        try:
            self._counter = open_shared(SHM_PREFIX, offer.progress, SHM_BYTES)
        except ValueError as e:
            raise ProtocolError(f"cuda_ipc setup record from {self.peer}: {e}") from None
        if self._counter is None:
            raise ConnectionLost(f"{self.peer}'s progress counter is not on this host (cuda_ipc needs one)")
        self._doorbell = Doorbell(self._counter, COUNTER.size)
        index = self._device.index if self._device.index is not None else torch.cuda.current_device()
        with on_device(self._device):
            # Mapped into this process's own device: copies into it run on this GPU's copy engines (mapped
            # as the owner's device they are far slower: docs/kv_transfer_protocol.md, "Measurements").
            storage = torch.UntypedStorage._new_shared_cuda(
                index, offer.handle, offer.size, offer.offset, offer.ref_counter, offer.ref_counter_offset,
                offer.event, offer.event_sync,
            )  # fmt: skip
            window = torch.empty(0, dtype=torch.uint8, device=self._device).set_(storage)
            if window.numel() < self._window_bytes:
                raise ConnectionLost(
                    f"{self.peer}'s window is {window.numel()} B, "
                    f"this end's window_bytes is {self._window_bytes}"
                )
            self._window = window
            self._freed = [torch.cuda.Event.from_ipc_handle(self._device, h) for h in offer.freed]
            self._copied = [_event() for _ in range(SLOTS)]
            copied = _handles(self._copied)
            self._stream = torch.cuda.Stream(self._device)
        await send_record(self._control, WindowAccept(copied))

    def _released(self) -> int:
        """Frames D has released so far (read from the shared counter)."""
        assert self._counter is not None
        return int(COUNTER.unpack_from(self._counter, 0)[0])

    async def _until(self, ready: Callable[[], bool], since: float, what: str) -> None:
        """Poll `ready` (spinning, then backing off) while the connection lives and the payload timeout
        has not passed."""

        def done() -> bool:
            self._check()
            if ready():
                return True
            if self._control.closed:
                raise ConnectionLost(f"the control connection to {self.peer} closed while waiting for {what}")
            if time.perf_counter() - since > self._liveness_s:
                raise ConnectionLost(f"{what} from {self.peer} not within {self._liveness_s}s")
            return False

        try:
            await poll(done)
        except ConnectionLost as e:
            self._fail(str(e))
            raise

    # P's side

    async def _copy(self, payload: torch.Tensor) -> None:
        """Copy `payload` (1-D uint8) into D's window as this connection's next payload."""
        assert self._window is not None and self._stream is not None, "payload before setup"
        if payload.device != self._device:  # e.g. a host buffer: stage it on this end's GPU
            payload = payload.to(self._device)
        seq, offset, must = self._ring.place(payload.numel())
        try:
            if must >= 0 and self._released() <= must:
                await self._until(lambda: self._released() > must, time.perf_counter(), "window space")
        except BaseException:  # nothing was copied or sent: the frame never happened
            self._ring.undo()
            raise
        with on_stream(self._stream):
            freed = self._freed[must % SLOTS] if must >= 0 else None
            if freed is not None and not freed.query():  # D's consumers still read those bytes
                self._stream.wait_event(freed)
            self._window.narrow(0, offset, payload.numel()).copy_(payload, non_blocking=True)
            self._copied[seq % SLOTS].record(self._stream)
        payload.record_stream(self._stream)  # its memory is not reused before the copy read it

    async def send(self, prefix: bytes, header: bytes, payload: torch.Tensor | None) -> None:
        """The copy is queued (and its "copied" event recorded) before the frame goes on the control
        connection, so D's wait on that event, made when the frame arrives, names this copy."""
        self._check()
        if payload is not None and payload.numel() > 0:
            await self._copy(payload)
        try:
            await self._control.send(prefix, header, None)
        except ConnectionLost as e:
            self._fail(f"control send failed: {e}")
            raise

    # D's side

    def release_payload(self) -> None:
        """The caller came back for the next frame: its consumers of the last payload are queued on their
        stream. Mark the window bytes free after them and tell P."""
        if self._held is None:
            return
        seq, consumer = self._held
        self._held = None
        with on_device(self._device):
            self._freed[seq % SLOTS].record(consumer)
        assert self._counter is not None
        COUNTER.pack_into(self._counter, 0, seq + 1)

    async def recv_payload(self, nbytes: int) -> torch.Tensor:
        """The next payload's view of the window; framing released the previous one before this frame."""
        self._check()
        assert self._held is None, "a payload is still held: framing releases it before the next frame"
        if self._window is None or self._rank != 0:
            raise ConnectionLost(f"{self.peer} sent a payload to the end that has no window")
        try:
            seq, offset, _ = self._ring.place(nbytes)
        except ValueError as e:
            self._fail(str(e))
            raise ConnectionLost(f"{self.peer}: {e}") from e
        consumer = torch.cuda.current_stream(self._device)
        consumer.wait_event(self._copied[seq % SLOTS])  # what the caller queues next runs after the copy
        self._held = (seq, consumer)
        self._last = seq
        return self._window[offset : offset + nbytes]

    async def flush(self) -> None:
        self._check()
        last = self._last
        if last is not None:
            await self._until(self._copied[last % SLOTS].query, time.perf_counter(), "a payload")

    # teardown

    def _unlink(self) -> None:
        if self._shared is not None:
            self._shared.unlink()
            self._shared = None

    def _fail(self, reason: str, level: int = logging.WARNING) -> None:
        if self._dead is None:
            self._dead = reason
            log.log(level, "closing the cuda_ipc channel with %s: %s", self.peer, reason)
        self._teardown(cut=True)

    def _teardown(self, cut: bool) -> None:
        """Let go of the window, events and counter, then (with `cut`) of the control connection. P drops its
        mapping first, so that D, seeing the connection end, finds its window released and frees it at once
        (torch keeps a window still mapped by the peer until it is let go and collected). If P's copies still
        run, a task waits for them before it drops the mapping and cuts the connection."""
        self._unlink()
        self._held = None
        self._freed, self._copied = [], []
        self._doorbell = None
        if self._counter is not None:
            self._counter.close()
            self._counter = None
        window, self._window = self._window, None
        stream = self._stream
        if window is not None and self._rank == 1 and stream is not None and not stream.query():
            with contextlib.suppress(RuntimeError):  # no running loop: drop now, cutting the copies short
                task = asyncio.get_running_loop().create_task(self._release_after(window, stream, cut))
                _DROPPING.add(task)
                task.add_done_callback(_DROPPING.discard)
                return
        if window is not None:
            with _unmapping(stream):
                del window
            if self._rank == 0:
                with torch.cuda.device(self._device):
                    torch.cuda.ipc_collect()  # frees it now, if the peer has let go already
        if cut:
            self._control.abort()

    async def _release_after(self, window: torch.Tensor, stream: torch.cuda.Stream, cut: bool) -> None:
        await poll(stream.query)
        with _unmapping(stream):
            del window
        if cut:
            self._control.abort()

    def abort(self) -> None:
        self._fail("connection aborted", logging.INFO)

    async def close(self) -> None:
        if self._dead is None:
            self._dead = "closed"
        if self._rank == 1 and self._stream is not None and self._window is not None:
            await poll(self._stream.query)  # the copies end before the mapping goes
        self._teardown(cut=False)
        await asyncio.gather(*_DROPPING)
        await self._control.close()


@contextlib.contextmanager
def _unmapping(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Where the last reference to a window goes. Dropping P's mapping makes torch tell D's process it may
    free the window, after synchronizing the current stream: make that P's idle copy stream, not the
    engine's."""
    if stream is None:
        yield
        return
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        yield


class IpcTransport(ControlTransport):
    """Dials and listens like the TCP transport; each connection gets its own window."""

    def __init__(self, config: ConnectorConfig) -> None:
        if torch.device(config.device).type != "cuda":
            raise ValueError(
                f"the cuda_ipc connector needs a CUDA ConnectorConfig.device, got {config.device!r}"
            )
        super().__init__("cuda_ipc", lambda control, rank, host: IpcChannel(control, rank, config))


CONNECTOR = ChannelConnector(IpcTransport, checksum_default=False, options=CudaIpcOptions)
