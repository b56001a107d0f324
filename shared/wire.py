"""The one codec of pdserve's messages: frozen dataclasses <-> JSON or msgpack, versioned, strictly checked.

A `Codec` serves one protocol at one version (the node protocol, the index records, the KV-transfer
headers). It encodes a message as a map of its fields plus `"v": version`, and decodes only a map with that
version whose fields are exactly the message's (none unknown, every one without a default present) and have
exactly their annotated types: no bool for an int, no int for a str, no string for a number; an int is taken
for a float. What the decoder refuses, and anything the message's own `__post_init__` refuses, becomes a
`WireError` naming the message and the field (`PrefillResult.first_token: expected int | None, got str
'x'`); malformed input never raises anything else.

Field types: int, float, bool, str, bytes (msgpack bin; lowercase hex in JSON), a NewType of one of them,
`U32Ids` (a tuple[int, ...] of uint32 that travels packed: little-endian uint32 bytes, as bytes travel; a
16k-token prompt is 64 KiB encoded and decoded in C instead of a 16k-item list walked in Python),
Literal[...], X | None, tuple[X, ...], tuple[A, B] (an array of exactly those), a NamedTuple (an array of
its fields), a dataclass (a nested map, without "v"), dict[str, X], dict[int, X] (decimal keys in JSON).
A float is finite on the wire: JSON's NaN and Infinity are refused both ways.

Why one module of about 440 lines: the decoder's checks are the encoder's field types read back, one walk
over the same annotations; split in two, every field type would have to be taught to both halves alike.

Why not a library: msgspec would fit but is installed neither here nor in the GPU image; pydantic, which is,
decodes JSON strictly, but in strict mode it takes a dataclass only as an instance from Python objects, so a
msgpack map could not go through the same checks as a JSON object.
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
import re
import sys
import types
import typing
from array import array
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Self, TypeVar, cast

import msgpack

_T = TypeVar("_T")
_Check = Callable[[str, object], object]  # (where, wire value) -> the field's value, or WireError
_Encode = Callable[[Any], object]  # the field's value -> its wire value
_ABSENT = object()
_DECIMAL = re.compile(r"-?[0-9]+")


class _PackedU32:
    """The `Annotated` marker of U32Ids."""


U32Ids = Annotated[tuple[int, ...], _PackedU32()]
"""A field of token ids (each in [0, 2**32)) that travels packed; to Python code it is a tuple[int, ...]."""
if array("I").itemsize != 4:
    raise ImportError(f"array('I') is {array('I').itemsize} bytes here; U32Ids needs 4-byte uint32")


class WireError(ValueError):
    """A message could not be decoded (or encoded): the text names the message, the field and the value."""


def _bad(where: str, expected: object, value: object) -> WireError:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return WireError(f"{where}: expected {_name(expected)}, got {type(value).__name__} {shown}")


def _name(annotation: object) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _reject_constant(name: str) -> float:
    raise WireError(f"{name} is not a finite number")


class Codec:
    """Encodes and decodes the messages of one protocol at one version."""

    def __init__(self, protocol: str, version: int) -> None:
        self.protocol = protocol
        self.version = version
        # per (class, json?): the compiled field decoders and encoders, built on first use
        self._decoders: dict[tuple[type, bool], _Check] = {}
        self._encoders: dict[tuple[type, bool], _Encode] = {}

    # ---- JSON -------------------------------------------------------------------------------------
    def to_json(self, msg: object) -> bytes:
        body = self._encoder(type(msg), True)(msg)
        try:
            return json.dumps(body, allow_nan=False, separators=(",", ":")).encode()
        except ValueError as e:  # a float that is not finite
            raise WireError(f"{type(msg).__name__}: {e}") from e

    def from_json(self, cls: type[_T], data: bytes | str) -> _T:
        try:
            obj = json.loads(data, parse_constant=_reject_constant)
        except WireError as e:
            raise WireError(f"{cls.__name__}: {e}") from None
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise WireError(f"{cls.__name__}: not JSON ({type(e).__name__}: {str(e)[:80]})") from None
        return self._top(cls, obj, True)

    # ---- msgpack ----------------------------------------------------------------------------------
    def to_msgpack(self, msg: object) -> bytes:
        return cast(bytes, msgpack.packb(self._encoder(type(msg), False)(msg), use_bin_type=True))

    def from_msgpack(self, cls: type[_T], data: bytes) -> _T:
        try:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=False)  # int keys too; checked by type
        except (ValueError, TypeError, RecursionError, msgpack.UnpackException) as e:
            raise WireError(f"{cls.__name__}: not msgpack ({type(e).__name__}: {str(e)[:80]})") from None
        return self._top(cls, obj, False)

    def fields(self, msg: object) -> dict[str, object]:
        """The message's JSON-ready map without the version: for a CLI's --json output, not the wire."""
        body = cast(dict[str, object], self._encoder(type(msg), True)(msg))
        del body["v"]
        return body

    # ---- shared -----------------------------------------------------------------------------------
    def _top(self, cls: type[_T], obj: object, as_json: bool) -> _T:
        if type(obj) is not dict:
            raise WireError(f"{cls.__name__}: expected a map, got {type(obj).__name__}")
        version = obj.pop("v", None)
        if version != self.version or type(version) is not int:
            raise WireError(
                f"{cls.__name__}: {self.protocol} version {version!r} is not {self.version}; both ends must "
                "run the same pdserve release"
            )
        return cast(_T, self._decoder(cls, as_json)(cls.__name__, obj))

    def _encoder(self, cls: type, as_json: bool) -> _Encode:
        key = (cls, as_json)
        enc = self._encoders.get(key)
        if enc is None:
            enc = self._encoders[key] = _dataclass_encoder(cls, as_json, {"v": self.version})
        return enc

    def _decoder(self, cls: type, as_json: bool) -> _Check:
        key = (cls, as_json)
        dec = self._decoders.get(key)
        if dec is None:
            dec = self._decoders[key] = _dataclass_check(cls, as_json)
        return dec


class JsonMessage:
    """A message whose JSON form is its protocol's codec's, named by `codec` in the subclass (a frozen
    dataclass, or the base of one protocol's messages): `to_json` and `from_json` at every call site."""

    codec: ClassVar[Codec]

    def to_json(self) -> bytes:
        return self.codec.to_json(self)

    @classmethod
    def from_json(cls, data: bytes | str) -> Self:
        return cls.codec.from_json(cls, data)


# ---- compiling a type into its checker and encoder -----------------------------------------------------
def local(default: Any) -> Any:
    """A message field that stays in the process that built it (a local clock reading): never encoded, its
    default when decoded, and left out of equality, so a message equals its round trip."""
    return dataclasses.field(default=default, compare=False, metadata={_LOCAL: True})


_LOCAL = "pdserve.wire.local"


def _hints(cls: type) -> list[tuple[str, object, bool]]:
    """(name, annotation, required) of each dataclass field that travels, in declaration order."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return [
        (f.name, hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        for f in dataclasses.fields(cls)
        if not f.metadata.get(_LOCAL)
    ]


def _packed(annotation: Any) -> bool | None:
    """For an Annotated type: whether it is U32Ids (else None: not Annotated)."""
    if typing.get_origin(annotation) is not Annotated:
        return None
    return any(isinstance(m, _PackedU32) for m in annotation.__metadata__)


def _unpack_u32(where: str, value: object, as_json: bool) -> tuple[int, ...]:
    if as_json and type(value) is str:
        try:
            value = bytes.fromhex(value)
        except ValueError:
            raise _bad(where, "hex digits of packed uint32", value) from None
    if type(value) is not bytes or len(value) % 4:
        raise _bad(where, "packed uint32 (4 bytes each)", value)
    ids = array("I")
    ids.frombytes(value)
    if sys.byteorder == "big":
        ids.byteswap()
    return tuple(ids)


def _pack_u32(value: tuple[int, ...]) -> bytes:
    try:
        ids = array("I", value)
    except (OverflowError, TypeError) as e:
        raise WireError(f"token ids must be integers in [0, 2**32): {e}") from None
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tobytes()


def _dataclass_check(cls: type, as_json: bool) -> _Check:
    assert dataclasses.is_dataclass(cls), f"{cls} is not a dataclass"
    # the field paths of a top-level message, built once (decoding runs per frame); nested ones on demand
    fields = [
        (name, f"{cls.__name__}.{name}", _check(hint, as_json), required)
        for name, hint, required in _hints(cls)
    ]
    known = {name for name, _, _, _ in fields}

    def check(where: str, value: object) -> object:
        if type(value) is not dict:
            raise _bad(where, cls, value)
        if not known.issuperset(value):
            unknown = sorted(str(k) for k in value if k not in known)
            raise WireError(f"{where}: unknown field(s) {unknown[:5]}")
        kwargs: dict[str, object] = {}
        top = where == cls.__name__
        for name, path, field_check, required in fields:
            item = value.get(name, _ABSENT)
            if item is not _ABSENT:
                kwargs[name] = field_check(path if top else f"{where}.{name}", item)
            elif required:
                raise WireError(f"{where}: lacks field {name!r}")
        try:
            return cls(**kwargs)
        except (ValueError, TypeError) as e:  # the message's own invariants (__post_init__)
            raise WireError(f"{where}: {e}") from None

    return check


def _check(annotation: Any, as_json: bool) -> _Check:
    """A function (where, wire value) -> value of `annotation`, raising WireError naming `where`."""
    packed = _packed(annotation)
    if packed:
        return lambda where, value: _unpack_u32(where, value, as_json)
    if packed is not None:  # another Annotated: its type alone
        return _check(annotation.__origin__, as_json)
    supertype = getattr(annotation, "__supertype__", None)
    if supertype is not None:  # a NewType
        return _check(supertype, as_json)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation in (int, bool, str) or (annotation is bytes and not as_json):

        def exact(where: str, value: object) -> object:
            if type(value) is annotation:  # `is`: a bool is not an int on the wire, nor an int a bool
                return value
            raise _bad(where, annotation, value)

        return exact
    if annotation is bytes:

        def hex_bytes(where: str, value: object) -> object:
            if type(value) is str:
                try:
                    return bytes.fromhex(value)
                except ValueError:
                    pass
            raise _bad(where, "hex digits", value)

        return hex_bytes
    if annotation is float:

        def number(where: str, value: object) -> object:
            if type(value) is float and math.isfinite(value):
                return value
            if type(value) is int:
                try:
                    return float(value)
                except OverflowError:
                    pass
            raise _bad(where, "a finite number", value)

        return number
    if origin is typing.Literal:
        allowed = {(type(a), a) for a in args}
        kinds = {type(a) for a in args}  # hashable ones (str, int, bool): test the type before the value

        def literal(where: str, value: object) -> object:
            if type(value) in kinds and (type(value), value) in allowed:
                return value
            raise _bad(where, f"one of {list(args)}", value)

        return literal
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        assert len(rest) == 1 and len(args) == 2, f"only X | None is supported, not {annotation}"
        inner = _check(rest[0], as_json)

        def optional(where: str, value: object) -> object:
            return None if value is None else inner(where, value)

        return optional
    if origin is tuple and Ellipsis not in args:  # tuple[A, B]: an array of exactly those
        parts = [_check(a, as_json) for a in args]

        def fixed(where: str, value: object) -> object:
            if type(value) is not list or len(value) != len(parts):
                raise _bad(where, annotation, value)
            return tuple(c(f"{where}[{i}]", v) for i, (c, v) in enumerate(zip(parts, value, strict=True)))

        return fixed
    if origin is tuple:
        assert len(args) == 2, f"only tuple[X, ...] or tuple[A, B, ...] is supported, not {annotation}"
        item_type = args[0]
        item = _check(item_type, as_json)

        plain = getattr(item_type, "__supertype__", item_type)
        one_pass = plain in (int, str, bool) or (plain is bytes and not as_json)

        def array(where: str, value: object) -> object:
            if type(value) is not list:
                raise _bad(where, annotation, value)
            if one_pass and set(map(type, value)) <= {plain}:  # block lists: one C-level pass
                return tuple(value)
            return tuple(item(f"{where}[{i}]", v) for i, v in enumerate(value))

        return array
    if origin is dict and args[0] is int and as_json:  # JSON keys are strings: decimal ones here

        def int_keys(where: str, value: object) -> object:
            if type(value) is not dict or not all(type(k) is str and _DECIMAL.fullmatch(k) for k in value):
                raise _bad(where, annotation, value)
            return {int(k): values(f"{where}.{k}", v) for k, v in value.items()}

        values = _check(args[1], as_json)
        return int_keys
    if origin is dict:
        assert args[0] in (str, int), f"only dict[str, X] and dict[int, X] are supported, not {annotation}"
        key_type = args[0]
        values = _check(args[1], as_json)

        def mapping(where: str, value: object) -> object:
            if type(value) is not dict or not all(type(k) is key_type for k in value):
                raise _bad(where, annotation, value)
            return {k: values(f"{where}.{k}", v) for k, v in value.items()}

        return mapping
    if isinstance(annotation, type) and issubclass(annotation, tuple) and hasattr(annotation, "_fields"):
        hints = typing.get_type_hints(annotation)
        names = annotation._fields
        items = [_check(hints[n], as_json) for n in names]
        ntuple = cast(Callable[..., object], annotation)

        def named(where: str, value: object) -> object:
            if type(value) is not list or len(value) != len(names):
                raise _bad(where, f"[{', '.join(names)}]", value)
            return ntuple(*(c(f"{where}.{n}", v) for c, n, v in zip(items, names, value, strict=True)))

        return named
    if dataclasses.is_dataclass(annotation):
        return _dataclass_check(cast(type, annotation), as_json)
    raise AssertionError(f"no wire encoding for {annotation}")


def _identity(value: object) -> object:
    return value


def _encode(annotation: Any, as_json: bool) -> _Encode | None:
    """A function value -> wire value for `annotation`, or None where the value is its own wire form
    (json and msgpack both write a tuple as an array)."""
    packed = _packed(annotation)
    if packed:
        return (lambda value: _pack_u32(value).hex()) if as_json else _pack_u32
    if packed is not None:
        return _encode(annotation.__origin__, as_json)
    supertype = getattr(annotation, "__supertype__", None)
    if supertype is not None:
        return _encode(supertype, as_json)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is bytes and as_json:
        return lambda value: value.hex()
    if origin in (typing.Union, types.UnionType):
        inner = _encode(next(a for a in args if a is not type(None)), as_json)
        if inner is None:
            return None
        return lambda value: None if value is None else inner(value)
    if origin is tuple and Ellipsis not in args:
        parts = [_encode(a, as_json) or _identity for a in args]
        if all(p is _identity for p in parts):
            return None
        return lambda value: [enc(v) for enc, v in zip(parts, value, strict=True)]
    if origin is tuple:
        item = _encode(args[0], as_json)
        return None if item is None else (lambda value: [item(v) for v in value])
    if origin is dict:
        entry = _encode(args[1], as_json) or _identity
        if args[0] is int and as_json:
            return lambda value: {str(k): entry(v) for k, v in value.items()}
        return None if entry is _identity else (lambda value: {k: entry(v) for k, v in value.items()})
    if isinstance(annotation, type) and issubclass(annotation, tuple) and hasattr(annotation, "_fields"):
        hints = typing.get_type_hints(annotation)
        items = [_encode(hints[n], as_json) or _identity for n in annotation._fields]
        if all(i is _identity for i in items):
            return None
        return lambda value: [enc(v) for enc, v in zip(items, value, strict=True)]
    if dataclasses.is_dataclass(annotation):
        return _dataclass_encoder(cast(type, annotation), as_json)
    return None


def _dataclass_encoder(cls: type, as_json: bool, head: dict[str, object] | None = None) -> _Encode:
    """The map of a dataclass's fields, after `head`'s entries (the version, at the top level)."""
    assert dataclasses.is_dataclass(cls), f"{cls} is not a dataclass"
    plan = [(name, _encode(hint, as_json)) for name, hint, _ in _hints(cls)]
    names = [name for name, _ in plan]
    values: Callable[[object], tuple[object, ...]] = (
        operator.attrgetter(*names)
        if len(names) > 1
        else (
            lambda msg: tuple(
                getattr(msg, n) for n in names
            )  # attrgetter of one name is not a tuple, of none fails
        )
    )
    converted = [(name, enc) for name, enc in plan if enc is not None]
    first = dict(head or {})
    if not converted:  # every field is its own wire form: a frozen dataclass's __dict__ is its fields

        def plain(msg: object) -> dict[str, object]:
            out = first.copy()
            out.update(msg.__dict__)
            return out

        return plain

    def encode(msg: object) -> dict[str, object]:
        out = first.copy()
        out.update(zip(names, values(msg), strict=True))
        for name, enc in converted:
            out[name] = enc(out[name])
        return out

    return encode
