"""The messages of KV-transfer protocol v5 and their header encoding (docs/kv_transfer_protocol.md).

Each message is a frozen dataclass with a one-byte wire type; its header is a msgpack map of its fields
(tuples as arrays, bytes as bin, `KVLayout` as a nested map). Decoding checks every field's wire type against
the dataclass annotation, so a malformed peer header becomes a `ProtocolError` naming the field, never a
half-built message. Only DATA carries a payload, and the payload is not part of the header.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack
from pdserve.kvtransfer.common import KVLayout, ProtocolError

PROTOCOL_VERSION = 5


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
    liveness_s: float = 0.0  # this end's liveness window: the peer pings at least every quarter of it


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


@dataclass(frozen=True)
class Ping:
    """Both ends, after READY, whenever they sent nothing for a quarter of the liveness window: the peer is
    alive even while no transfer runs (framing.FramedConnection.keep_alive)."""

    TYPE: ClassVar[int] = 12


Message = Hello | Auth | Ready | Error | Open | OpenOk | OpenRefusal | Data | Complete | Ack | Abort | Ping
MESSAGE_TYPES: dict[int, type[Message]] = {
    cls.TYPE: cls
    for cls in (Hello, Auth, Ready, Error, Open, OpenOk, OpenRefusal, Data, Complete, Ack, Abort, Ping)
}


# Per message class, its fields resolved once into (name, checker, required): decoding runs on every frame,
# and get_type_hints / dataclasses.fields per call cost more than the checks themselves.
_Checker = Callable[[str, object], object]


def _bad(where: str, annotation: object, value: object) -> ProtocolError:
    return ProtocolError(f"bad {where}: expected {annotation}, got {type(value).__name__} {value!r:.80}")


def _checker(annotation: object) -> _Checker:
    """A function (where, value) -> value converted to `annotation`, raising ProtocolError naming `where`."""
    if annotation in (int, bool, str, bytes):

        def exact(where: str, value: object) -> object:
            if type(value) is annotation:  # `is`: a bool is not an int on the wire, nor an int a bool
                return value
            raise _bad(where, annotation, value)

        return exact
    if annotation is float:

        def number(where: str, value: object) -> object:
            if type(value) in (int, float):
                return float(typing.cast(float, value))
            raise _bad(where, annotation, value)

        return number
    if typing.get_origin(annotation) is tuple:
        item_type = typing.get_args(annotation)[0]
        item = _checker(item_type)

        def array(where: str, value: object) -> object:
            if type(value) is not list:
                raise _bad(where, annotation, value)
            if not value or set(map(type, value)) == {item_type}:  # block lists: one C-level pass
                return tuple(value)
            return tuple(item(f"{where}[{i}]", v) for i, v in enumerate(value))

        return array
    if typing.get_origin(annotation) is dict:

        def mapping(where: str, value: object) -> object:
            if isinstance(value, dict) and all(type(k) is str for k in value):
                return value
            raise _bad(where, annotation, value)

        return mapping
    assert annotation is KVLayout, f"no wire encoding for {annotation}"

    def layout(where: str, value: object) -> object:
        if not isinstance(value, dict):
            raise _bad(where, annotation, value)
        try:
            return KVLayout(**value)
        except (TypeError, ValueError) as e:
            raise ProtocolError(f"bad {where}: {e}") from e

    return layout


_CODECS: dict[type[Message], tuple[tuple[str, str, _Checker, bool], ...]] = {
    cls: tuple(
        (f.name, f"{cls.__name__}.{f.name}", _checker(hint), f.default is dataclasses.MISSING)
        for f in dataclasses.fields(cls)
        for hint in (typing.get_type_hints(cls)[f.name],)
    )
    for cls in MESSAGE_TYPES.values()
}


def encode_header(msg: Message) -> bytes:
    """The fields as a msgpack map, in declaration order (a frozen dataclass's `__dict__` holds exactly its
    fields, in that order; msgpack packs tuples as arrays itself; only HELLO's layout needs a nested map)."""
    body: dict[str, object] = msg.__dict__
    if isinstance(msg, Hello):
        body = body | {"layout": dataclasses.asdict(msg.layout)}
    return typing.cast(bytes, msgpack.packb(body, use_bin_type=True))


_ABSENT = object()


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
    if type(body) is not dict:
        raise ProtocolError(f"{cls.__name__} header must be a map, got {type(body).__name__}")
    kwargs: dict[str, object] = {}
    for name, where, check, required in _CODECS[cls]:
        value = body.get(name, _ABSENT)
        if value is not _ABSENT:
            kwargs[name] = check(where, value)
        elif required:
            raise ProtocolError(f"{cls.__name__} header lacks field {name!r}")
    return cls(**kwargs)  # type: ignore[arg-type]


def transfer_id_of(msg_type: int, header: bytes) -> str | None:
    """The transfer id of a header that may be damaged, or None when it cannot be read."""
    try:
        msg = decode_header(msg_type, header)
    except ProtocolError:
        return None
    tid = getattr(msg, "transfer_id", None)
    return tid if isinstance(tid, str) else None
