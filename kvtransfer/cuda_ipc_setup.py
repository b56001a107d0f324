"""The cuda_ipc connector's two setup records (kvtransfer/cuda_ipc.py), through the one codec.

After the handshake, D offers its window (`WindowOffer`) and P answers with its events (`WindowAccept`), each
as a u32 length and the codec's msgpack map at the KV-transfer protocol's version (a change to a record bumps
it: docs/kv_transfer_protocol.md). A record the codec refuses is the peer's `ProtocolError`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TypeVar

from pdserve.kvtransfer.common import ProtocolError
from pdserve.kvtransfer.messages import PROTOCOL_VERSION
from pdserve.kvtransfer.tcp import TcpChannel
from pdserve.kvtransfer.window_ring import SLOTS
from pdserve.shared.wire import Codec, WireError

RECORD_LEN = struct.Struct("<I")
MAX_RECORD_BYTES = 1 << 16
SETUP_CODEC = Codec("cuda_ipc setup record", PROTOCOL_VERSION)


def _check_events(name: str, handles: tuple[bytes, ...]) -> None:
    if len(handles) != SLOTS:
        raise ValueError(f"{name} must hold {SLOTS} event handles, got {len(handles)}")


@dataclass(frozen=True)
class WindowOffer:
    """D's setup record: its window as torch exports it (`UntypedStorage._share_cuda_()`: the allocation's
    handle, the window's place in it, torch's IPC reference count and the allocation's event), its "freed"
    events and the token of its shared file (the progress counter and the ACK doorbell)."""

    handle: bytes
    size: int
    offset: int
    ref_counter: bytes
    ref_counter_offset: int
    event: bytes
    event_sync: bool
    freed: tuple[bytes, ...]
    progress: bytes

    def __post_init__(self) -> None:
        _check_events("freed", self.freed)


@dataclass(frozen=True)
class WindowAccept:
    """P's answer, once it mapped the window: its "copied" events."""

    copied: tuple[bytes, ...]

    def __post_init__(self) -> None:
        _check_events("copied", self.copied)


_Record = TypeVar("_Record", WindowOffer, WindowAccept)


async def send_record(control: TcpChannel, record: WindowOffer | WindowAccept) -> None:
    """One setup record on the control connection: its length (u32), then the codec's msgpack map."""
    body = SETUP_CODEC.to_msgpack(record)
    await control.send(RECORD_LEN.pack(len(body)), body, None)


async def recv_record(control: TcpChannel, cls: type[_Record]) -> _Record:
    """The peer's next setup record; ProtocolError (from the codec's WireError) when it is not a `cls`."""
    (size,) = RECORD_LEN.unpack(await control.recv_exact(RECORD_LEN.size))
    if size > MAX_RECORD_BYTES:
        raise ProtocolError(f"cuda_ipc setup record of {size} B from {control.peer}")
    try:
        return SETUP_CODEC.from_msgpack(cls, await control.recv_exact(size))
    except WireError as e:
        raise ProtocolError(f"{control.peer} sent a bad cuda_ipc setup record: {e}") from e
