"""Frames over a byte channel: a 24-byte prefix, a msgpack header, an optional raw payload, a CRC-32C.

A transport only moves the three parts of a frame in order (`ByteChannel`); everything the protocol says
about framing (magic, version, sizes, checksum) lives here, once, for every connector.

Payload first: on a connection without checksums, a DATA frame travels as two frames. The first carries the
payload and no header (flag PAYLOAD_FIRST), so it leaves P before P has checked and encoded the header, and
D can post its receive for it at once; the second carries the header and no payload (flag HEADER_AFTER),
or, when P could not build the header, nothing at all: D then drops the payload it received.

Invariants: frames on one connection are sent whole and never interleaved (one send lock per
`FramedConnection`, held across both halves of a payload-first DATA); a frame with a bad checksum is
reported as `ChecksumError` after its bytes were consumed, so the stream stays in sync whenever the prefix
itself was intact; until the handshake authenticated the peer, a frame announcing any payload or a header
over MAX_HANDSHAKE_HEADER_BYTES is refused from its 24-byte prefix, before anything more is read; a
PAYLOAD_FIRST frame is always followed by its HEADER_AFTER frame; a payload is received only once the
previous one was released (at the next `recv`, or by the function `defer_release` returned).
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import crc32c
import torch
from pdserve.kvtransfer.common import ChecksumError, ConnectionLost, ProtocolError
from pdserve.kvtransfer.messages import (
    PROTOCOL_VERSION,
    Data,
    Message,
    Ping,
    decode_header,
    encode_header,
    transfer_id_of,
)

MAGIC = b"PDKV"
PREFIX = struct.Struct("<4sBBBxIQI")  # magic, version, type, flags, pad, header_len, payload_len, crc32c
PREFIX_SIZE = PREFIX.size  # 24
CRC_COVERED = PREFIX_SIZE - 4  # the checksum covers the prefix up to (not including) itself
FLAG_CHECKSUM = 0x01
FLAG_PAYLOAD_FIRST = 0x02  # a DATA frame's payload, without its header (which follows)
FLAG_HEADER_AFTER = 0x04  # the header of the preceding payload-first frame (none: that frame is dropped)
MAX_HEADER_BYTES = 16 << 20
MAX_HANDSHAKE_HEADER_BYTES = 4096  # HELLO, AUTH, READY, ERROR: a few hundred bytes each
log = logging.getLogger("pdserve.kvtransfer")


class ByteChannel(Protocol):
    """One connection of a transport, the whole interface of every connector: `send` parts are read back with
    the same sizes, in order; an empty part is not read back (framing never asks for 0 bytes). A connector's
    channel subclasses this; the bodies here are what a channel does whose payload is whole and in place when
    `recv_payload` returns, with no frame limit and no ACK doorbell (TCP's), and a connector overrides what
    differs, so framing, sender and receiver call every method on every channel."""

    @property
    def peer(self) -> str: ...

    @property
    def heard_at(self) -> float:
        """time.monotonic() when bytes from the peer last arrived (a payload's chunks count as they come)."""
        ...

    host_payloads: bool = False
    """Payloads travel through host memory (TCP): a checksummed CUDA payload is then staged once, for the
    checksum and the send together."""

    @property
    def payload_limit(self) -> int | None:
        """The most payload bytes one frame may carry on this channel (None: `max_payload_bytes` alone)."""
        return None

    async def send(self, prefix: bytes, header: bytes, payload: torch.Tensor | None) -> None:
        """payload: 1-D contiguous uint8 in host or device memory, or None; a transport that cannot send
        device memory stages it through the host. A device payload must be complete (the kernels that wrote it
        finished) before the call. The call returns once the frame is handed over; a GPU transport may still
        be reading the payload then (it keeps the tensor alive until its op is done), so the caller must not
        write into it again."""

    async def authenticated(self) -> None:
        """Called on both ends once the handshake succeeded (after READY), before any other frame: sets up
        what the transport needs for payloads (a side link, its buffers)."""

    async def recv_exact(self, nbytes: int) -> bytes: ...

    async def recv_payload(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 tensor of `nbytes` received bytes, valid until the caller released it
        (`release_payload`; a transport may reuse one buffer per connection). It may be returned while its
        bytes still land: then either work the caller queues on its current stream runs after they landed,
        or `payload_landed()` is False until `landed()` was awaited."""

    def payload_landed(self) -> bool:
        """Whether the payload `recv_payload` returned last may be read now: its bytes are in place, or work
        queued on the caller's current stream is ordered after them. False: await `landed()` first."""
        return True

    async def landed(self) -> None:
        """Return once the payload `recv_payload` returned last has fully arrived (raise ConnectionLost if it
        failed)."""
        return None

    async def flush(self) -> None:
        """Return once every payload op posted so far has finished (raise ConnectionLost if one failed);
        D calls it before it handles COMPLETE, so an ACK always means the KV is in D's blocks."""
        return None

    def release_payload(self) -> None:
        """Every consumer of the last payload is queued on the caller's current stream (or ran): its
        memory may be reused after them. A no-op when no payload is held."""
        return None

    def ring_ack(self, key: bytes) -> None:
        """D: the transfer of `key` is acknowledged, its ACK frame follows. A channel whose ends share a host
        may ring a doorbell (doorbell.py) that P, spinning for the ACK, finds first."""
        return None

    def ack_rung(self, key: bytes) -> bool:
        """P: whether D rang `key` (False without a doorbell)."""
        return False

    def abort(self) -> None:
        """Cut the connection now; pending and later calls raise ConnectionLost."""

    async def close(self) -> None: ...


class VersionMismatch(ProtocolError):
    def __init__(self, peer_version: int) -> None:
        super().__init__(f"peer speaks protocol v{peer_version}, this node v{PROTOCOL_VERSION}")
        self.peer_version = peer_version


@dataclass(frozen=True)
class Frame:
    msg: Message
    payload: torch.Tensor | None  # [payload_len] uint8, only on DATA


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D uint8 tensor sharing its memory."""
    assert tensor.is_contiguous(), "payload tensors must be contiguous"
    return tensor.reshape(-1).view(torch.uint8)


def host_copy(payload: torch.Tensor) -> torch.Tensor:
    """A payload's bytes in host memory: itself when it is there, else a copy in pinned memory (several
    times faster than pageable; torch's host allocator caches the buffers). Waits for the copy."""
    if payload.device.type == "cpu":
        return payload
    host = torch.empty(payload.shape, dtype=payload.dtype, pin_memory=True)
    host.copy_(payload)
    return host


def _crc(parts: list[bytes | torch.Tensor]) -> int:
    """CRC-32C (Castagnoli; the SSE4.2 / ARMv8 instruction through the crc32c package: about 11 GiB/s on one
    core of the CI VM against zlib.crc32's 3.9)."""
    crc = 0
    for part in parts:
        crc = crc32c.crc32c(part.numpy().data if isinstance(part, torch.Tensor) else part, crc)
    return crc


def encode_frame(
    msg: Message, payload: torch.Tensor | None, checksum: bool, host_payloads: bool = False
) -> tuple[bytes, bytes, torch.Tensor | None]:
    """(prefix, header, payload bytes) of one frame; the checksum is over prefix[:20], header and payload.
    With `host_payloads` (the channel sends from host memory) a checksummed payload is returned as the host
    copy the checksum read, so it is staged once."""
    header = encode_header(msg)
    body = None if payload is None else as_bytes(payload)
    nbytes = 0 if body is None else body.numel()
    flags = FLAG_CHECKSUM if checksum else 0
    prefix = PREFIX.pack(MAGIC, PROTOCOL_VERSION, msg.TYPE, flags, len(header), nbytes, 0)
    if checksum:
        parts: list[bytes | torch.Tensor] = [prefix[:CRC_COVERED], header]
        if body is not None:
            host = host_copy(body)
            parts.append(host)
            body = host if host_payloads else body
        prefix = prefix[:CRC_COVERED] + struct.pack("<I", _crc(parts))
    return prefix, header, body


class FramedConnection:
    """A channel plus the connection's checksum policy and payload limit."""

    def __init__(self, channel: ByteChannel, max_payload_bytes: int) -> None:
        self.channel = channel
        self.checksum = True  # until the handshake settles it, every frame is checked
        self.authenticated = False  # set by the handshake at READY: until then frames carry no payload
        self.max_payload_bytes = max_payload_bytes
        self._send_lock = asyncio.Lock()
        self._sent_at = time.monotonic()
        self.silent: str | None = None  # set when keep_alive cut the channel: why
        self.peer_liveness_s = 0.0  # the peer's liveness window, from its HELLO (0: not stated)
        self._released = asyncio.Event()  # clear while a `defer_release` caller still uses the last payload
        self._released.set()

    async def send(self, msg: Message, payload: torch.Tensor | None = None) -> None:
        prefix, header, body = encode_frame(msg, payload, self.checksum, self.channel.host_payloads)
        async with self._send_lock:
            await self.channel.send(prefix, header, body)
            self._sent_at = time.monotonic()

    async def keep_alive(self, liveness_s: float) -> None:
        """Run (as a task, cancelled when the connection ends) from READY on: sends PING whenever this end
        sent nothing for a quarter of the shorter of `liveness_s` and the peer's window."""
        interval = min(liveness_s, self.peer_liveness_s or liveness_s) / 4
        while True:
            await asyncio.sleep(interval)
            if time.monotonic() - self._sent_at >= interval and not self._send_lock.locked():
                try:
                    await self.send(Ping())
                except ConnectionLost:
                    return

    async def watch(self, liveness_s: float) -> None:
        """Run (as a task, cancelled when the connection ends) from READY on: cuts the channel once nothing
        arrived from the peer for `liveness_s` (`silent` says why; the reader then sees ConnectionLost). A
        turn that comes late (this process stalled) skips the check once, so bytes that arrived meanwhile
        count first."""
        interval = liveness_s / 4
        while True:
            before = time.monotonic()
            await asyncio.sleep(interval)
            now = time.monotonic()
            if now - before > 2 * interval:
                continue
            quiet = now - self.channel.heard_at
            if quiet > liveness_s:
                self.silent = f"{self.channel.peer} silent for {quiet:.1f}s (liveness window {liveness_s}s)"
                log.warning("cutting the transfer connection: %s", self.silent)
                self.channel.abort()
                return

    async def send_built(self, build: Callable[[], Data], payload: torch.Tensor) -> None:
        """Send the DATA frame of `build()` carrying `payload`. Without checksums the payload goes first, so
        it moves while `build` checks and encodes the header; an exception from `build` then sends the empty
        HEADER_AFTER that tells D to drop the payload, and is re-raised (with checksums, nothing is sent)."""
        async with self._send_lock:
            if self.checksum:
                await self.channel.send(*encode_frame(build(), payload, True, self.channel.host_payloads))
                self._sent_at = time.monotonic()
                return
            body = as_bytes(payload)
            first = PREFIX.pack(MAGIC, PROTOCOL_VERSION, Data.TYPE, FLAG_PAYLOAD_FIRST, 0, body.numel(), 0)
            await self.channel.send(first, b"", body)
            try:
                header = encode_header(build())
            except Exception:
                await self.channel.send(_header_after(0), b"", None)
                raise
            await self.channel.send(_header_after(len(header)), header, None)
            self._sent_at = time.monotonic()

    async def _prefix(self) -> tuple[bytes, int, int, int, int, int, int]:
        raw = await self.channel.recv_exact(PREFIX_SIZE)
        magic, version, msg_type, flags, header_len, payload_len, crc = PREFIX.unpack(raw)
        if magic != MAGIC:
            raise ProtocolError(f"bad frame magic {magic!r}, expected {MAGIC!r}")
        if not self.authenticated and (payload_len or header_len > MAX_HANDSHAKE_HEADER_BYTES):
            raise ProtocolError(
                f"frame type {msg_type} before authentication announces a {payload_len} B payload and a "
                f"{header_len} B header (allowed: none, and at most {MAX_HANDSHAKE_HEADER_BYTES} B)"
            )
        if header_len > MAX_HEADER_BYTES or payload_len > self.max_payload_bytes:
            raise ProtocolError(
                f"frame too large: header {header_len} B (max {MAX_HEADER_BYTES}), "
                f"payload {payload_len} B (max {self.max_payload_bytes})"
            )
        return raw, version, msg_type, flags, header_len, payload_len, crc

    async def _header(self, nbytes: int) -> bytes:
        return await self.channel.recv_exact(nbytes) if nbytes else b""

    def defer_release(self) -> Callable[[], None]:
        """Keep the payload `recv` returned last beyond the next `recv` (its consumers are queued later, by a
        task): frames without a payload are still read, the next payload only once the returned function
        was called (exactly once, after those consumers were queued)."""
        self._released.clear()

        def release() -> None:
            self.channel.release_payload()
            self._released.set()

        return release

    async def _payload(self, nbytes: int) -> torch.Tensor:
        await self._released.wait()
        return await self.channel.recv_payload(nbytes)

    async def recv(self) -> Frame:
        """The next frame. Unless it called `defer_release`, the caller is done with the previous frame's
        payload: its consumers are queued."""
        while True:
            if self._released.is_set():
                self.channel.release_payload()
            raw, version, msg_type, flags, header_len, payload_len, crc = await self._prefix()
            if flags & FLAG_PAYLOAD_FIRST:
                frame = await self._payload_first(version, msg_type, flags, header_len, payload_len)
                if frame is None:  # P could not build its header: the payload is dropped
                    continue
                return frame
            if flags & FLAG_HEADER_AFTER:
                raise ProtocolError(f"frame type {msg_type} flagged HEADER_AFTER without a payload before it")
            header = await self._header(header_len)
            payload = await self._payload(payload_len) if payload_len else None
            if version != PROTOCOL_VERSION:  # raised once the frame is consumed, so an ERROR reply can follow
                raise VersionMismatch(version)
            if flags & FLAG_CHECKSUM:
                parts: list[bytes | torch.Tensor] = [raw[:CRC_COVERED], header]
                if payload is not None:
                    await self.channel.landed()
                    parts.append(host_copy(payload))
                actual = _crc(parts)
                if actual != crc:
                    raise ChecksumError(
                        f"frame type {msg_type} failed its checksum: crc32c {actual:#010x}, sent {crc:#010x}",
                        transfer_id_of(msg_type, header),
                    )
            elif self.checksum:
                raise ProtocolError(f"frame type {msg_type} carries no checksum on a checksummed connection")
            return Frame(decode_header(msg_type, header), payload)

    async def _payload_first(
        self, version: int, msg_type: int, flags: int, header_len: int, payload_len: int
    ) -> Frame | None:
        """The payload of a payload-first DATA, then its HEADER_AFTER frame; None when P dropped it."""
        if version != PROTOCOL_VERSION or self.checksum:
            raise ProtocolError(f"a payload-first frame on a v{version}, checksum={self.checksum} connection")
        if msg_type != Data.TYPE or flags != FLAG_PAYLOAD_FIRST or header_len or not payload_len:
            raise ProtocolError(
                f"bad payload-first frame: type {msg_type}, flags {flags:#x}, header {header_len} B, "
                f"payload {payload_len} B"
            )
        payload = await self._payload(payload_len)
        _, version, msg_type, flags, header_len, payload_len, _ = await self._prefix()
        if (version, msg_type, flags, payload_len) != (PROTOCOL_VERSION, Data.TYPE, FLAG_HEADER_AFTER, 0):
            raise ProtocolError(
                f"a payload-first frame followed by type {msg_type}, flags {flags:#x}, "
                f"payload {payload_len} B instead of its header"
            )
        if not header_len:
            return None
        return Frame(decode_header(msg_type, await self._header(header_len)), payload)


def _header_after(header_len: int) -> bytes:
    return PREFIX.pack(MAGIC, PROTOCOL_VERSION, Data.TYPE, FLAG_HEADER_AFTER, header_len, 0, 0)
