"""A fuzzer of the node protocol's decoder (shared/wire.py under node_protocol.py): whatever bytes arrive,
decoding gives a valid message or the codec's own `WireError`, never another exception; a message it accepts
encodes again to the same message. Inputs: random bytes, and valid messages with one value anywhere in them
replaced by random JSON (wrong types, missing and unknown fields, deep nesting, huge numbers)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from pdserve.shared.node.node_protocol import CODEC, AbortRequest
from pdserve.shared.wire import Codec, WireError
from pdserve.tests.harness.messages import NODE_EXAMPLES

KINDS = [type(m) for m in NODE_EXAMPLES]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(-(10**400), 10**400) | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def decode_or_refuse(kind: type, data: bytes | str) -> None:
    try:
        msg: object = CODEC.from_json(kind, data)
    except WireError:
        return
    assert CODEC.from_json(kind, CODEC.to_json(msg)) == msg


def paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a decoded JSON value, as the keys and indices leading to it."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += paths(v, (*prefix, i))
    return out


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(KINDS), st.binary(max_size=200))
def test_random_bytes_are_refused_cleanly(kind: type, data: bytes) -> None:
    decode_or_refuse(kind, data)


@settings(max_examples=600, deadline=None)
@given(
    st.integers(0, len(NODE_EXAMPLES) - 1),
    st.data(),
    json_values,
    st.sampled_from(["replace", "drop", "add"]),
)
def test_one_damaged_value_is_refused_cleanly(which: int, data: st.DataObject, value: Any, how: str) -> None:
    msg = NODE_EXAMPLES[which]
    obj = json.loads(CODEC.to_json(msg))
    path = data.draw(st.sampled_from(paths(obj)))
    if not path:
        obj = value
    else:
        parent = obj
        for key in path[:-1]:
            parent = parent[key]
        if how == "replace" or isinstance(parent, list):
            parent[path[-1]] = value
        elif how == "drop":
            del parent[path[-1]]
        else:
            parent[f"{path[-1]}_extra"] = value
    decode_or_refuse(type(msg), json.dumps(obj, allow_nan=True))


def test_deep_nesting_and_non_finite_numbers_are_wire_errors() -> None:
    for data in ("[" * 100_000, '{"v": 1, "request_id": NaN}', b"\xff\xfe", '{"v": 1, "request_id": "r"} x'):
        try:
            AbortRequest.from_json(data)
        except WireError:
            continue
        raise AssertionError(f"{data[:20]!r} was accepted")


@dataclass(frozen=True)
class _Keyed:
    per_bucket: dict[int, float]
    names: dict[str, int]


def test_int_keyed_maps_round_trip_and_bad_keys_are_wire_errors() -> None:
    codec = Codec("test", 3)
    msg = _Keyed({16: 0.5, 2048: 1e-4}, {"a": 1})
    assert codec.from_json(_Keyed, codec.to_json(msg)) == msg
    assert codec.from_msgpack(_Keyed, codec.to_msgpack(msg)) == msg
    for bad in (
        '{"v": 3, "per_bucket": {"x": 1.0}, "names": {}}',
        '{"v": 3, "per_bucket": {}, "names": {"a": 1.5}}',
    ):
        try:
            codec.from_json(_Keyed, bad)
        except WireError:
            continue
        raise AssertionError(f"{bad} was accepted")
