"""The messages of KV-transfer protocol v1 and their header encoding (docs/kv_transfer_protocol.md).

Each message is a frozen dataclass with a one-byte wire type; its header is a msgpack map of its fields
(tuples as arrays, bytes as bin, `KVLayout` as a nested map). Decoding checks every field's wire type against
the dataclass annotation, so a malformed peer header becomes a `ProtocolError` naming the field, never a
half-built message. Only DATA carries a payload, and the payload is not part of the header.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack
from pdserve.kvtransfer.common import KVLayout, ProtocolError

PROTOCOL_VERSION = 1


@dataclass(frozen=True)
class Hello:
    """Both ends, first: identity, layout, a fresh nonce; D's reply adds its HMAC proof."""

    TYPE: ClassVar[int] = 1
    version: int
    node_id: str
    fingerprint: bytes
    layout: KVLayout
    nonce: bytes
    checksum: bool
    proof: bytes = b""


@dataclass(frozen=True)
class Auth:
    """P's HMAC proof, sent after it has verified D's."""

    TYPE: ClassVar[int] = 2
    proof: bytes


@dataclass(frozen=True)
class Ready:
    """D accepted P's proof: the connection may carry transfers."""

    TYPE: ClassVar[int] = 3


@dataclass(frozen=True)
class Error:
    """Connection-level refusal or protocol violation; the sender closes the connection after it."""

    TYPE: ClassVar[int] = 4
    code: str
    detail: str


@dataclass(frozen=True)
class Open:
    """P reserves `num_blocks` blocks on D for `transfer_id`; `block_hashes` name the prompt's full blocks."""

    TYPE: ClassVar[int] = 5
    transfer_id: str
    block_hashes: tuple[bytes, ...]
    num_blocks: int
    deadline: float


@dataclass(frozen=True)
class OpenOk:
    TYPE: ClassVar[int] = 6
    transfer_id: str
    num_held_blocks: int
    dst_block_ids: tuple[int, ...]


@dataclass(frozen=True)
class OpenRefusal:
    TYPE: ClassVar[int] = 7
    transfer_id: str
    reason: str


@dataclass(frozen=True)
class Data:
    """Layers [layer_start, layer_start + num_layers) of the listed blocks; payload [nl, 2, n, B, Hkv, D]."""

    TYPE: ClassVar[int] = 8
    transfer_id: str
    layer_start: int
    num_layers: int
    block_indices: tuple[int, ...]
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]


@dataclass(frozen=True)
class Complete:
    TYPE: ClassVar[int] = 9
    transfer_id: str
    first_token: dict[str, Any]


@dataclass(frozen=True)
class Ack:
    TYPE: ClassVar[int] = 10
    transfer_id: str


@dataclass(frozen=True)
class Abort:
    TYPE: ClassVar[int] = 11
    transfer_id: str
    reason: str


Message = Hello | Auth | Ready | Error | Open | OpenOk | OpenRefusal | Data | Complete | Ack | Abort
MESSAGE_TYPES: dict[int, type[Message]] = {
    cls.TYPE: cls
    for cls in (Hello, Auth, Ready, Error, Open, OpenOk, OpenRefusal, Data, Complete, Ack, Abort)
}


# Field annotations resolved once: get_type_hints evaluates the string annotations on every call.
_HINTS: dict[type[Message], dict[str, object]] = {
    cls: typing.get_type_hints(cls) for cls in MESSAGE_TYPES.values()
}


def _to_wire(value: object) -> object:
    """msgpack packs tuples as arrays itself; only the layout needs turning into a map."""
    if isinstance(value, KVLayout):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    return value


def encode_header(msg: Message) -> bytes:
    body = {f.name: _to_wire(getattr(msg, f.name)) for f in dataclasses.fields(msg)}
    return typing.cast(bytes, msgpack.packb(body, use_bin_type=True))


def _check(where: str, annotation: object, value: object) -> object:
    """`value` converted to the annotated type, or ProtocolError naming `where`."""
    origin = typing.get_origin(annotation)
    if annotation is int and type(value) is int:
        return value
    if annotation is float and type(value) in (int, float):
        return float(typing.cast(float, value))
    if annotation is bool and type(value) is bool:
        return value
    if annotation in (str, bytes) and type(value) is annotation:
        return value
    if origin is tuple and isinstance(value, list):
        item_type = typing.get_args(annotation)[0]
        if item_type in (int, bytes, str) and all(type(v) is item_type for v in value):
            return tuple(value)  # the common case (block lists), checked in one pass
        return tuple(_check(f"{where}[{i}]", item_type, v) for i, v in enumerate(value))
    if origin is dict and isinstance(value, dict) and all(type(k) is str for k in value):
        return value
    if annotation is KVLayout and isinstance(value, dict):
        try:
            return KVLayout(**value)
        except (TypeError, ValueError) as e:
            raise ProtocolError(f"bad {where}: {e}") from e
    raise ProtocolError(f"bad {where}: expected {annotation}, got {type(value).__name__} {value!r:.80}")


def decode_header(msg_type: int, header: bytes) -> Message:
    cls = MESSAGE_TYPES.get(msg_type)
    if cls is None:
        raise ProtocolError(
            f"unknown message type {msg_type}; v{PROTOCOL_VERSION} knows {sorted(MESSAGE_TYPES)}"
        )
    try:
        body = msgpack.unpackb(header, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as e:
        raise ProtocolError(f"{cls.__name__} header is not msgpack: {e}") from e
    if not isinstance(body, dict):
        raise ProtocolError(f"{cls.__name__} header must be a map, got {type(body).__name__}")
    hints = _HINTS[cls]
    kwargs: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        if f.name in body:
            kwargs[f.name] = _check(f"{cls.__name__}.{f.name}", hints[f.name], body[f.name])
        elif f.default is dataclasses.MISSING:
            raise ProtocolError(f"{cls.__name__} header lacks field {f.name!r}")
    return cls(**kwargs)  # type: ignore[arg-type]


def transfer_id_of(msg_type: int, header: bytes) -> str | None:
    """The transfer id of a header that may be damaged, or None when it cannot be read."""
    try:
        msg = decode_header(msg_type, header)
    except ProtocolError:
        return None
    tid = getattr(msg, "transfer_id", None)
    return tid if isinstance(tid, str) else None
