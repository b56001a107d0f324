"""The messages of KV-transfer protocol v6 and their header encoding (docs/kv_transfer_protocol.md).

Each message is a frozen dataclass with a one-byte wire type; its header is the one codec's msgpack map of its
fields and the version (shared/wire.py: tuples as arrays, bytes as bin, `KVLayout` and `FirstToken` as nested
maps). Decoding checks every field's wire type against the dataclass annotation, so a malformed peer header
becomes a `ProtocolError` naming the field, never a half-built message. Only DATA carries a payload, and the
payload is not part of the header.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, dataclass_transform, get_args

from pdserve.kvtransfer.common import ProtocolError
from pdserve.shared.types import BlockHash, FirstToken, KVLayout, RequestId
from pdserve.shared.wire import Codec, WireError

PROTOCOL_VERSION = 8


@dataclass_transform(frozen_default=True)
class _Message:
    """Every message: a frozen dataclass whose one-byte wire type is given with its class,
    `class Ack(_Message, type=10)`."""

    TYPE: ClassVar[int]

    def __init_subclass__(cls, *, type: int) -> None:
        super().__init_subclass__()
        cls.TYPE = type
        dataclass(frozen=True)(cls)


class Hello(_Message, type=1):
    """Both ends, first: identity, layout, a fresh nonce; D's reply adds its HMAC proof."""

    version: int
    node_id: str
    fingerprint: bytes
    layout: KVLayout
    nonce: bytes
    checksum: bool
    proof: bytes = b""
    liveness_s: float = 0.0  # this end's liveness window: the peer pings at least every quarter of it


class Auth(_Message, type=2):
    """P's HMAC proof, sent after it has verified D's."""

    proof: bytes


class Ready(_Message, type=3):
    """D accepted P's proof: the connection may carry transfers."""


class Error(_Message, type=4):
    """Connection-level refusal or protocol violation; the sender closes the connection after it."""

    code: str
    detail: str


class Open(_Message, type=5):
    """P reserves `num_blocks` blocks on D for `transfer_id` (every block of the prompt, a trailing partial
    one included); `block_hashes` name its full blocks; `deadline` in unix seconds. D's handler gets it as it
    came (`TransferHandler.on_open`), once the receiver checked the deadline and the counts."""

    transfer_id: RequestId
    block_hashes: tuple[BlockHash, ...]
    num_blocks: int
    deadline: float


class OpenOk(_Message, type=6):
    transfer_id: str
    num_held_blocks: int
    dst_block_ids: tuple[int, ...]


class OpenRefusal(_Message, type=7):
    transfer_id: str
    reason: str


class Data(_Message, type=8):
    """Layers [layer_start, layer_start + num_layers) of the listed blocks; payload [nl, 2, n, B, Hkv, D]."""

    transfer_id: str
    layer_start: int
    num_layers: int
    block_indices: tuple[int, ...]
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]


class Complete(_Message, type=9):
    transfer_id: str
    first_token: FirstToken | None  # None: the transfer carried only KV (a prefix fetch)


class Ack(_Message, type=10):
    transfer_id: str


class Abort(_Message, type=11):
    transfer_id: str
    reason: str


class Ping(_Message, type=12):
    """Both ends, after READY, whenever they sent nothing for a quarter of the liveness window: the peer is
    alive even while no transfer runs (framing.FramedConnection.keep_alive)."""


Message = Hello | Auth | Ready | Error | Open | OpenOk | OpenRefusal | Data | Complete | Ack | Abort | Ping
MESSAGE_TYPES: dict[int, type[Message]] = {cls.TYPE: cls for cls in get_args(Message)}


CODEC = Codec("KV-transfer protocol", PROTOCOL_VERSION)


def encode_header(msg: Message) -> bytes:
    """The message's fields as a msgpack map (with the version), through the one codec."""
    return CODEC.to_msgpack(msg)


def decode_header(msg_type: int, header: bytes) -> Message:
    cls = MESSAGE_TYPES.get(msg_type)
    if cls is None:
        raise ProtocolError(
            f"unknown message type {msg_type}; v{PROTOCOL_VERSION} knows {sorted(MESSAGE_TYPES)}"
        )
    try:
        return CODEC.from_msgpack(cls, header)
    except WireError as e:
        raise ProtocolError(f"bad {e}") from None


def transfer_id_of(msg_type: int, header: bytes) -> str | None:
    """The transfer id of a header that may be damaged, or None when it cannot be read."""
    try:
        msg = decode_header(msg_type, header)
    except ProtocolError:
        return None
    tid = getattr(msg, "transfer_id", None)
    return tid if isinstance(tid, str) else None
