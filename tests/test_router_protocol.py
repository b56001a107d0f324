"""node/node_protocol.py: every message round-trips through its JSON form; bad input is refused by name."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pdserve.shared.engine.sampling_params import SamplingParams
from pdserve.shared.node.node_protocol import (
    CODEC,
    LOGPROB_FLOOR,
    PROTOCOL_VERSION,
    AbortRequest,
    NodeGenerateRequest,
    NodeInfoReply,
    PrefillRequest,
    PrefillResult,
    StepOutput,
    TokenLogprob,
    TopLogprob,
)
from pdserve.shared.types import NodeId, RequestId
from pdserve.shared.wire import WireError

ids = st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40).map(tuple)
names = st.text(st.characters(codec="utf-8"), min_size=1, max_size=20)
finite = st.floats(min_value=LOGPROB_FLOOR, max_value=0.0, allow_nan=False)
raw_bytes = st.one_of(st.none(), st.lists(st.integers(0, 255), max_size=6).map(tuple))
sampling = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 4096),
    temperature=st.floats(0.0, 2.0),
    seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    stop=st.lists(names, max_size=3).map(tuple),
    logprobs=st.one_of(st.none(), st.integers(0, 20)),
)
deadlines = st.floats(1.0, 4e9)
salts = st.one_of(st.none(), st.text(max_size=10))
tops = st.builds(TopLogprob, token=st.text(max_size=5), token_id=st.integers(0, 50000), logprob=finite,
                 bytes=raw_bytes)  # fmt: skip
token_logprobs = st.builds(
    TokenLogprob, token_id=st.integers(0, 50000), token=st.text(max_size=5), logprob=finite, bytes=raw_bytes,
    top=st.lists(tops, max_size=3).map(tuple),
)  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(ids, sampling, salts, deadlines, st.one_of(st.none(), st.just(NodeId("p0"))))
def test_generate_request_round_trips(prompt, params, salt, deadline, prefill) -> None:
    req = NodeGenerateRequest(RequestId("r-1"), prompt, params, salt, deadline, prefill)
    assert NodeGenerateRequest.from_json(req.to_json()) == req


@settings(max_examples=60, deadline=None)
@given(ids, sampling, salts, deadlines)
def test_prefill_request_round_trips(prompt, params, salt, deadline) -> None:
    req = PrefillRequest(RequestId("r-1"), prompt, params, salt, deadline, NodeId("d0"), "127.0.0.1:9000")
    assert PrefillRequest.from_json(req.to_json()) == req


def test_token_ids_travel_packed_and_ids_beyond_uint32_are_refused() -> None:
    req = NodeGenerateRequest(RequestId("r"), (0, 7, 2**32 - 1), SamplingParams(), None, 1e9)
    assert CODEC.from_msgpack(NodeGenerateRequest, CODEC.to_msgpack(req)) == req
    assert NodeGenerateRequest.from_json(req.to_json()) == req
    with pytest.raises(WireError, match=r"\[0, 2\*\*32\)"):
        NodeGenerateRequest(RequestId("r"), (2**32,), SamplingParams(), None, 1e9).to_json()


@settings(max_examples=100, deadline=None)
@given(
    st.lists(token_logprobs, max_size=4),
    st.booleans(),
    st.sampled_from([None, "stop", "length"]),
    st.text(max_size=20),
    st.integers(0, 10**6),
)
def test_step_output_round_trips(lps, with_logprobs, finish, text, count) -> None:
    token_ids = tuple(lp.token_id for lp in lps)
    logprobs = tuple(lps) if with_logprobs else None
    step = StepOutput(RequestId("r"), token_ids, text, logprobs, finish, count, count, count // 2)
    line = step.to_line()
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert StepOutput.from_line(line) == step


def test_error_step_and_small_messages_round_trip() -> None:
    step = StepOutput(RequestId("r"), (), "", None, "error", 3, 0, 0, error="KV transfer cut")
    assert StepOutput.from_line(step.to_line()) == step
    result = PrefillResult(RequestId("r"), 42, 100, 28, 7)
    assert PrefillResult.from_json(result.to_json()) == result
    failed = PrefillResult(RequestId("r"), None, 0, 0, 0, error="decode node refused the handshake")
    assert PrefillResult.from_json(failed.to_json()) == failed
    assert AbortRequest.from_json(AbortRequest(RequestId("x")).to_json()) == AbortRequest(RequestId("x"))
    info = NodeInfoReply(NodeId("d0"), "decode", "SmolLM2", 8192, 16)
    assert NodeInfoReply.from_json(info.to_json()) == info


def test_minus_infinity_is_clamped_and_nan_refused() -> None:
    lp = TokenLogprob(5, "a", -math.inf, None, (TopLogprob("b", 6, -math.inf, (98,)),))
    step = StepOutput(RequestId("r"), (5,), "a", (lp,), None, 1, 1, 0)
    back = StepOutput.from_line(step.to_line())
    assert back.logprobs is not None
    assert back.logprobs[0].logprob == LOGPROB_FLOOR and back.logprobs[0].top[0].logprob == LOGPROB_FLOOR
    with pytest.raises(ValueError, match="NaN"):
        StepOutput(
            RequestId("r"), (5,), "a", (TokenLogprob(5, "a", math.nan, None),), None, 1, 1, 0
        ).to_line()


def test_wire_format_is_versioned_and_explicit() -> None:
    req = NodeGenerateRequest(RequestId("r"), (1, 2), SamplingParams(max_tokens=3), None, 1e9)
    obj = json.loads(req.to_json())
    # token ids travel packed: little-endian uint32, lowercase hex in JSON
    assert obj["v"] == PROTOCOL_VERSION and obj["prompt_token_ids"] == "0100000002000000"
    assert obj["sampling"]["max_tokens"] == 3
    obj["v"] = PROTOCOL_VERSION + 1
    with pytest.raises(ValueError, match="protocol version"):
        NodeGenerateRequest.from_json(json.dumps(obj))


@pytest.mark.parametrize(
    ("patch", "match"),
    [
        ({"prompt_token_ids": ""}, "prompt_token_ids is empty"),
        ({"prompt_token_ids": "010000000200"}, "prompt_token_ids: expected packed uint32"),
        ({"prompt_token_ids": "01zz0000"}, "prompt_token_ids: expected hex digits"),
        ({"prompt_token_ids": [1, 2]}, "prompt_token_ids: expected packed uint32"),
        ({"deadline": "soon"}, "deadline"),
        ({"deadline": -1}, "deadline"),
        ({"request_id": 7}, "request_id"),
        ({"sampling": {"max_tokens": 0}}, "max_tokens"),
        ({"sampling": {"bogus": 1}}, "bogus"),
    ],
)
def test_bad_generate_requests_are_refused_by_name(patch: dict[str, object], match: str) -> None:
    obj = json.loads(NodeGenerateRequest(RequestId("r"), (1,), SamplingParams(), None, 1e9).to_json())
    obj.update(patch)
    with pytest.raises(ValueError, match=match):
        NodeGenerateRequest.from_json(json.dumps(obj))


def test_step_output_invariants() -> None:
    with pytest.raises(ValueError, match="finish_reason"):
        StepOutput(RequestId("r"), (), "", None, "done", 0, 0, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="logprobs for 2 new tokens"):
        StepOutput(RequestId("r"), (1, 2), "", (TokenLogprob(1, "a", -1.0, None),), None, 0, 2, 0)
    with pytest.raises(ValueError, match="error set"):
        StepOutput(RequestId("r"), (), "", None, "stop", 0, 0, 0, error="x")
    with pytest.raises(ValueError, match="first_token"):
        PrefillResult(RequestId("r"), None, 1, 0, 0)
    with pytest.raises(ValueError, match="role"):
        NodeInfoReply(NodeId("n"), "router", "m", 10, 16)  # type: ignore[arg-type]
    line = StepOutput(RequestId("r"), (1,), "a", (TokenLogprob(1, "a", -1.0, (3,)),), None, 0, 1, 0).to_line()
    with pytest.raises(ValueError, match="bytes out of range"):
        StepOutput.from_line(line.replace(b'"bytes":[3]', b'"bytes":[300]'))
