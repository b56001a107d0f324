"""Frames over a byte channel: a 24-byte prefix, a msgpack header, an optional raw payload, a CRC32.

A transport only moves the three parts of a frame in order (`ByteChannel`); everything the protocol says
about framing (magic, version, sizes, checksum) lives here, once, for every connector. Invariants: frames on
one connection are sent whole and never interleaved (one send lock per `FramedConnection`); a frame with
a bad checksum is reported as `ChecksumError` after its bytes were consumed, so the stream stays in sync
whenever the prefix itself was intact.
"""

from __future__ import annotations

import asyncio
import struct
import typing
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from pdserve.kvtransfer.common import ChecksumError, ProtocolError
from pdserve.kvtransfer.messages import (
    PROTOCOL_VERSION,
    Message,
    decode_header,
    encode_header,
    transfer_id_of,
)

MAGIC = b"PDKV"
PREFIX = struct.Struct("<4sBBBxIQI")  # magic, version, type, flags, pad, header_len, payload_len, crc32
PREFIX_SIZE = PREFIX.size  # 24
CRC_COVERED = PREFIX_SIZE - 4  # the checksum covers the prefix up to (not including) itself
FLAG_CHECKSUM = 0x01
MAX_HEADER_BYTES = 16 << 20


class ByteChannel(Protocol):
    """One connection of a transport. `send` parts are read back with the same sizes, in order."""

    @property
    def peer(self) -> str: ...

    async def send(self, prefix: bytes, header: bytes, payload: torch.Tensor | None) -> None:
        """payload: 1-D contiguous uint8 in host or device memory, or None; a transport that cannot send
        device memory stages it through the host. A device payload must be complete (the kernels that wrote it
        finished) before the call. The call returns once the frame is handed over; a GPU transport may still
        be reading the payload then (it keeps the tensor alive until its op is done), so the caller must not
        write into it again."""

    async def authenticated(self) -> None:
        """Called on both ends once the handshake succeeded (after READY), before any other frame: sets up
        what the transport needs for payloads (nccl's communicator); a no-op for TCP and UCX."""

    async def recv_exact(self, nbytes: int) -> bytes: ...

    async def recv_payload(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 tensor of `nbytes` received bytes, valid until the next call (a GPU transport reuses
        one device buffer per connection). A GPU transport may return it while the bytes are still landing:
        work the caller then queues on its current stream runs after they landed (such a transport is also
        a `DeferredPayloads`)."""

    def abort(self) -> None:
        """Cut the connection now; pending and later calls raise ConnectionLost."""

    async def close(self) -> None: ...


@runtime_checkable
class DeferredPayloads(Protocol):
    """A channel whose `recv_payload` may return before the bytes landed (nccl on a GPU)."""

    async def flush(self) -> None:
        """Return once every payload op posted so far has finished (raise ConnectionLost if one failed);
        D calls it before it handles COMPLETE, so an ACK always means the KV is in D's blocks."""


@runtime_checkable
class EarlyPayloads(Protocol):
    """A channel that can start moving a frame's payload before the frame's header exists (cuda_ipc): the
    payload then moves while the header is checked and encoded."""

    @property
    def payload_limit(self) -> int:
        """The largest payload one frame may carry."""

    async def start_payload(self, payload: torch.Tensor) -> None:
        """Begin moving `payload` (1-D uint8) as the next frame's; the next `send` carries it."""

    def drop_payload(self) -> None:
        """The started payload's frame will not be sent (its header could not be built)."""


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


def _crc(parts: list[bytes | torch.Tensor]) -> int:
    crc = 0
    for part in parts:
        crc = zlib.crc32(part.numpy().data if isinstance(part, torch.Tensor) else part, crc)
    return crc


def encode_frame(
    msg: Message, payload: torch.Tensor | None, checksum: bool
) -> tuple[bytes, bytes, torch.Tensor | None]:
    """(prefix, header, payload bytes) of one frame; the checksum is over prefix[:20], header and payload."""
    header = encode_header(msg)
    body = None if payload is None else as_bytes(payload)
    nbytes = 0 if body is None else body.numel()
    flags = FLAG_CHECKSUM if checksum else 0
    prefix = PREFIX.pack(MAGIC, PROTOCOL_VERSION, msg.TYPE, flags, len(header), nbytes, 0)
    if checksum:
        parts: list[bytes | torch.Tensor] = [prefix[:CRC_COVERED], header]
        if body is not None:
            parts.append(body.cpu())
        prefix = prefix[:CRC_COVERED] + struct.pack("<I", _crc(parts))
    return prefix, header, body


class FramedConnection:
    """A channel plus the connection's checksum policy and payload limit."""

    def __init__(self, channel: ByteChannel, max_payload_bytes: int) -> None:
        self.channel = channel
        self.checksum = True  # until the handshake settles it, every frame is checked
        self.max_payload_bytes = max_payload_bytes
        self._send_lock = asyncio.Lock()
        self._early = isinstance(channel, EarlyPayloads)
        # the largest payload one frame may carry on this channel (None: max_payload_bytes)
        self.payload_limit = typing.cast(EarlyPayloads, channel).payload_limit if self._early else None

    async def send(self, msg: Message, payload: torch.Tensor | None = None) -> None:
        prefix, header, body = encode_frame(msg, payload, self.checksum)
        async with self._send_lock:
            await self.channel.send(prefix, header, body)

    async def send_built(self, build: Callable[[], Message], payload: torch.Tensor) -> None:
        """Send the frame of `build()` carrying `payload`. On an `EarlyPayloads` channel (and unless frames
        are checksummed) the payload starts moving first; an exception from `build` sends nothing."""
        early = self._early and not self.checksum
        async with self._send_lock:
            if early:
                await typing.cast(EarlyPayloads, self.channel).start_payload(as_bytes(payload))
            try:
                prefix, header, body = encode_frame(build(), payload, self.checksum)
            except BaseException:
                if early:
                    typing.cast(EarlyPayloads, self.channel).drop_payload()
                raise
            await self.channel.send(prefix, header, body)

    async def recv(self) -> Frame:
        raw = await self.channel.recv_exact(PREFIX_SIZE)
        magic, version, msg_type, flags, header_len, payload_len, crc = PREFIX.unpack(raw)
        if magic != MAGIC:
            raise ProtocolError(f"bad frame magic {magic!r}, expected {MAGIC!r}")
        if header_len > MAX_HEADER_BYTES or payload_len > self.max_payload_bytes:
            raise ProtocolError(
                f"frame too large: header {header_len} B (max {MAX_HEADER_BYTES}), "
                f"payload {payload_len} B (max {self.max_payload_bytes})"
            )
        header = await self.channel.recv_exact(header_len)
        payload = await self.channel.recv_payload(payload_len) if payload_len else None
        if version != PROTOCOL_VERSION:  # raised once the frame is consumed, so an ERROR reply can follow
            raise VersionMismatch(version)
        if flags & FLAG_CHECKSUM:
            parts: list[bytes | torch.Tensor] = [raw[:CRC_COVERED], header]
            if payload is not None:
                parts.append(payload.cpu())
            actual = _crc(parts)
            if actual != crc:
                raise ChecksumError(
                    f"frame type {msg_type} failed its checksum: crc32 {actual:#010x}, sent {crc:#010x}",
                    transfer_id_of(msg_type, header),
                )
        elif self.checksum:
            raise ProtocolError(f"frame type {msg_type} carries no checksum on a checksummed connection")
        return Frame(decode_header(msg_type, header), payload)
