"""router/anthropic_api.py, anthropic_events.py, responses_api.py and responses_events.py as pure
translations: requests into chat completions bodies (tools, tool results, stop sequences, text formats),
chat answers and fake chat chunk streams (text, thoughts, tool calls, a failure) into Messages / Responses
objects and events, each validated with the official SDKs' own types (`anthropic`, `openai`)."""

from __future__ import annotations

import asyncio
import json
import typing
from collections.abc import AsyncGenerator
from typing import Any

import anthropic.types as at
import openai.types.responses as rt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pdserve.router import anthropic_api, anthropic_events, responses_api, responses_events
from pdserve.router.chat_bridge import ChatResult, stream_error
from pdserve.router.openai_protocol import OpenAIError

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
USAGE = {
    "prompt_tokens": 20,
    "completion_tokens": 5,
    "total_tokens": 25,
    "prompt_tokens_details": {"cached_tokens": 16},
}


BASE = {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "hi"}]}


def anthropic_req(**kw: Any) -> anthropic_api.MessagesRequest:
    return anthropic_api.MessagesRequest.model_validate({**BASE, **kw})


def test_anthropic_request_becomes_a_chat_body_with_tools_and_tool_messages() -> None:
    req = anthropic_req(
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "call it", "signature": "x"},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "21C"}],
                    },
                    {"type": "text", "text": "Thanks"},
                ],
            },
        ],
        tools=[{"name": "weather", "description": "now", "input_schema": WEATHER}],
        tool_choice={"type": "tool", "name": "weather", "disable_parallel_tool_use": True},
        stop_sequences=["END"],
        temperature=0.5,
        top_k=4,
        metadata={"user_id": "u1"},
        stream=True,
    )
    assert anthropic_api.to_chat(req) == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "Let me look.",
                "tool_calls": [
                    {
                        "id": "toolu_1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": "21C"},
            {"role": "user", "content": "Thanks"},
        ],
        "tools": [
            {"type": "function", "function": {"name": "weather", "parameters": WEATHER, "description": "now"}}
        ],
        "tool_choice": {"type": "function", "function": {"name": "weather"}},
        "parallel_tool_calls": False,
        "max_tokens": 9,
        "temperature": 0.5,
        "top_k": 4,
        "user": "u1",
        "stop": ["END"],
        "include_stop_str_in_output": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert anthropic_api.to_chat(anthropic_req(tool_choice={"type": "any"}))["tool_choice"] == "required"
    structured = anthropic_req(output_config={"format": {"type": "json_schema", "schema": WEATHER}})
    assert anthropic_api.to_chat(structured)["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": WEATHER, "strict": True},
    }
    with pytest.raises(anthropic_events.AnthropicError, match="effort"):
        anthropic_api._parse(anthropic_api.MessagesRequest, {**BASE, "output_config": {"effort": "high"}})


def test_anthropic_message_from_chat_with_stop_sequence_and_tool_call() -> None:
    chat: dict[str, Any] = {
        "model": "m",
        "usage": USAGE,
        "choices": [
            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "four END"}}
        ],
    }
    msg = at.Message.model_validate(anthropic_events.to_message(chat, ["END"]))
    assert msg.content[0].type == "text" and msg.content[0].text == "four "
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", "END")
    assert (msg.usage.input_tokens, msg.usage.cache_read_input_tokens, msg.usage.output_tokens) == (4, 16, 5)
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city":"Oslo"}'},
    }
    chat["choices"][0].update(
        finish_reason="tool_calls", message={"role": "assistant", "content": None, "tool_calls": [call]}
    )
    msg = at.Message.model_validate(anthropic_events.to_message(chat, []))
    assert msg.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "input", None)) for b in msg.content] == [("tool_use", {"city": "Oslo"})]
    chat["choices"][0].update(finish_reason="length", message={"role": "assistant", "content": "abc"})
    assert anthropic_events.to_message(chat, ["c"])["stop_reason"] == "stop_sequence"
    assert anthropic_events.to_message(chat, [])["stop_reason"] == "max_tokens"


def _chunks(*deltas: dict[str, Any], finish: str = "stop", fail: bool = False) -> ChatResult:
    async def gen() -> AsyncGenerator[dict[str, Any], None]:
        yield {
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
        }
        for i, d in enumerate(deltas):
            last = i == len(deltas) - 1
            yield {"choices": [{"index": 0, "delta": d, "finish_reason": finish if last else None}]}
        if fail:
            yield {
                "error": {"message": "node died", "type": "server_error", "param": None, "code": "node_error"}
            }
        yield {"choices": [], "usage": USAGE}

    return ChatResult(200, chunks=gen())


async def _twenty() -> int:
    return 20


def _events(stream: Any) -> list[tuple[str, dict[str, Any]]]:
    async def collect() -> list[bytes]:
        return [b async for b in stream]

    out = []
    for item in asyncio.run(collect()):
        head, data = item.decode().rstrip("\n").split("\n")
        kind, obj = head.removeprefix("event: "), json.loads(data.removeprefix("data: "))
        assert obj["type"] == kind
        out.append((kind, obj))
    return out


def _by_type(union: Any) -> dict[str, Any]:
    """The SDK's event classes by their `type` literal (its unions carry no discriminator)."""
    members = (
        typing.get_args(typing.get_args(union)[0]) if typing.get_origin(union) is typing.Annotated else ()
    )
    members = members or typing.get_args(union)
    return {typing.get_args(m.model_fields["type"].annotation)[0]: m for m in members}


ANTHROPIC_EVENTS = _by_type(at.RawMessageStreamEvent)


def test_anthropic_stream_events_for_thought_text_stop_sequence_and_tool_use() -> None:
    result = _chunks(
        {"reasoning_content": "hmm"},
        {"content": "It is E"},
        {"content": "N"},
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_9",
                    "type": "function",
                    "function": {"name": "weather", "arguments": ""},
                }
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"Rome"}'}}]},
        finish="tool_calls",
    )
    events = _events(anthropic_events.to_events(result, "m", ["END"], _twenty))
    for kind, obj in events:
        if kind != "ping":
            ANTHROPIC_EVENTS[kind].model_validate(obj)
    kinds = [k for k, _ in events]
    assert kinds[:3] == ["message_start", "content_block_start", "ping"]
    assert events[0][1]["message"]["usage"]["input_tokens"] == 20
    assert kinds[-2:] == ["message_delta", "message_stop"]
    starts = [o["content_block"]["type"] for k, o in events if k == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    assert kinds.count("content_block_stop") == 3
    text = "".join(o["delta"].get("text", "") for k, o in events if k == "content_block_delta")
    assert text == "It is EN"  # "EN" could have begun "END": held back, then released when it did not
    args = "".join(o["delta"].get("partial_json", "") for k, o in events if k == "content_block_delta")
    assert json.loads(args) == {"city": "Rome"}
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "tool_use" and delta["usage"]["output_tokens"] == 5


def test_anthropic_stream_cuts_the_stop_sequence_and_reports_it() -> None:
    events = _events(
        anthropic_events.to_events(
            _chunks({"content": "one two E"}, {"content": "ND"}), "m", ["END"], _twenty
        )
    )
    text = "".join(o["delta"].get("text", "") for k, o in events if k == "content_block_delta")
    assert text == "one two " and events[-2][1]["delta"] == {
        "stop_reason": "stop_sequence",
        "stop_sequence": "END",
    }


def test_anthropic_stream_failure_is_an_error_event() -> None:
    events = _events(anthropic_events.to_events(_chunks({"content": "a"}, fail=True), "m", [], _twenty))
    assert events[-1] == ("error", {"type": "error", "error": {"type": "api_error", "message": "node died"}})
    busy = {"message": "no node", "type": "server_error", "param": None, "code": "node_unavailable"}
    err = stream_error({"error": busy})
    assert err is not None and err.status == 503
    assert anthropic_events.AnthropicError.of(err).body()["error"]["type"] == "overloaded_error"


@settings(max_examples=300, deadline=None)
@given(
    st.text("ab", max_size=12),
    st.lists(st.text("ab", min_size=1, max_size=3), min_size=1, max_size=3),
    st.lists(st.integers(0, 12), max_size=4),
)
def test_stop_tail_in_any_cut_equals_the_whole(text: str, stops: list[str], cuts: list[int]) -> None:
    """Streamed text (held back while it may grow into a stop sequence) adds up to the whole text's cut."""
    whole = anthropic_events.StopTail(stops)
    expected = whole.feed(text), whole.finish()
    tail, out, last = anthropic_events.StopTail(stops), "", 0
    for cut in [*sorted(c for c in cuts if c <= len(text)), len(text)]:
        out += tail.feed(text[last:cut])
        last = cut
    rest, matched = tail.finish()
    assert (out + rest, matched) == (expected[0] + expected[1][0], expected[1][1])


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens: Field required"),
        (
            {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "messages.0.content",
        ),
        (
            {
                "model": "m",
                "max_tokens": 5,
                "temperature": 1.5,
                "messages": [{"role": "user", "content": "x"}],
            },
            "temperature",
        ),
        (["x"], "must be a JSON object"),
    ],
)
def test_anthropic_bad_requests_are_400_in_anthropic_shape(body: Any, message: str) -> None:
    with pytest.raises(anthropic_events.AnthropicError) as info:
        anthropic_api._parse(anthropic_api.MessagesRequest, body)
    err = info.value.body()
    assert info.value.status == 400 and err["type"] == "error"
    assert err["error"]["type"] == "invalid_request_error" and message in err["error"]["message"]


def responses_req(**kw: Any) -> responses_api.ResponsesRequest:
    return responses_api.parse_request({"model": "m", "input": "hi", **kw})


def _head(**kw: Any) -> responses_events.ResponseHead:
    return responses_events.ResponseHead(responses_api.echoed(responses_req(**kw)))


def test_responses_request_becomes_a_chat_body() -> None:
    req = responses_req(
        instructions="Be brief.",
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
            {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city":"Oslo"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "3C"},
        ],
        tools=[{"type": "function", "name": "weather", "parameters": WEATHER, "strict": True}],
        tool_choice={"type": "function", "name": "weather"},
        text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}},
        max_output_tokens=30,
        temperature=0.2,
        store=False,
    )
    assert responses_api.to_chat(req) == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city":"Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "3C"},
        ],
        "max_tokens": 30,
        "temperature": 0.2,
        "tools": [
            {"type": "function", "function": {"name": "weather", "parameters": WEATHER, "strict": True}}
        ],
        "tool_choice": {"type": "function", "function": {"name": "weather"}},
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "w", "schema": WEATHER, "strict": True},
        },
    }


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0]"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"type": "reasoning"}]}, "input"),
    ],
)
def test_responses_bad_requests_are_400_naming_the_parameter(kw: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        responses_api.to_chat(responses_req(**kw))
    assert (info.value.status, info.value.param) == (400, param), info.value.message
    if param == "previous_response_id":
        assert "stores no responses" in info.value.message


def test_responses_body_from_chat_validates_against_the_sdk_type() -> None:
    head = _head(tools=[{"type": "function", "name": "weather", "parameters": WEATHER}])
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city":"Oslo"}'},
    }
    chat: dict[str, Any] = {
        "model": "m",
        "usage": USAGE,
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": "think",
                    "tool_calls": [call],
                },
            }
        ],
    }
    resp = rt.Response.model_validate(responses_events.to_response(head, chat))
    assert [o.type for o in resp.output] == ["reasoning", "function_call"]
    assert isinstance(resp.output[1], rt.ResponseFunctionToolCall) and resp.output[1].call_id == "call_1"
    assert resp.usage is not None and resp.usage.total_tokens == 25
    chat["choices"][0].update(finish_reason="length", message={"role": "assistant", "content": "partial"})
    resp = rt.Response.model_validate(responses_events.to_response(head, chat))
    assert resp.status == "incomplete" and resp.output_text == "partial"


RESPONSES_EVENTS = _by_type(rt.ResponseStreamEvent)


def test_responses_stream_events_validate_and_add_up() -> None:
    head = _head()
    result = _chunks(
        {"reasoning_content": "hm"},
        {"content": "Hel"},
        {"content": "lo"},
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "f", "arguments": '{"a"'},
                }
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]},
    )
    events = _events(responses_events.to_events(head, result))
    for kind, obj in events:
        RESPONSES_EVENTS[kind].model_validate(obj)
    assert [o["sequence_number"] for _, o in events] == list(range(len(events)))
    kinds = [k for k, _ in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed"
    for k in (
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.function_call_arguments.done",
    ):
        assert k in kinds
    done = dict(events)["response.output_text.done"]
    assert done["text"] == "Hello"
    final = rt.Response.model_validate(events[-1][1]["response"])
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Hello" and final.output[2].arguments == '{"a":1}'  # type: ignore[union-attr]


def test_responses_stream_failure_is_an_error_event() -> None:
    events = _events(responses_events.to_events(_head(), _chunks({"content": "a"}, fail=True)))
    assert events[-1][0] == "error" and events[-1][1]["message"] == "node died"
    RESPONSES_EVENTS["error"].model_validate(events[-1][1])


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)
ANTHROPIC_FIELDS = [
    "model",
    "max_tokens",
    "messages",
    "system",
    "tools",
    "tool_choice",
    "stop_sequences",
    "temperature",
    "top_k",
    "thinking",
    "output_config",
    "metadata",
    "stream",
]
RESPONSES_FIELDS = [
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "text",
    "max_output_tokens",
    "previous_response_id",
    "store",
    "reasoning",
    "stream",
]


def _typed(kinds: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """Dicts of one of `kinds` with random fields, some of them the ones that kind has."""
    fields = [
        "text",
        "id",
        "name",
        "input",
        "content",
        "tool_use_id",
        "role",
        "call_id",
        "arguments",
        "output",
    ]
    return st.builds(
        lambda kind, rest: {**rest, "type": kind},
        st.sampled_from(kinds),
        st.dictionaries(st.sampled_from(fields), JSON, max_size=4),
    )


def _fuzzed(draw: Any, base: dict[str, Any], fields: list[str]) -> dict[str, Any]:
    body = dict(base)
    for name in draw(st.lists(st.sampled_from(fields), max_size=3)):
        body[name] = draw(JSON)
    return body


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_hostile_anthropic_bodies_are_refused_by_name_never_crash(data: st.DataObject) -> None:
    body = _fuzzed(data.draw, BASE, ANTHROPIC_FIELDS)
    if data.draw(st.booleans()):
        body["messages"] = [
            {
                "role": data.draw(st.sampled_from(["user", "assistant"])),
                "content": data.draw(
                    st.lists(_typed(["text", "tool_use", "tool_result", "thinking", "image"]), max_size=3)
                ),
            }
        ]
    try:
        anthropic_api.to_chat(anthropic_api._parse(anthropic_api.MessagesRequest, body))
    except anthropic_events.AnthropicError as exc:
        assert exc.status == 400 and exc.message


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_hostile_responses_bodies_are_refused_by_name_never_crash(data: st.DataObject) -> None:
    body = _fuzzed(data.draw, {"model": "m", "input": "hi"}, RESPONSES_FIELDS)
    if data.draw(st.booleans()):
        kinds = ["message", "function_call", "function_call_output", "reasoning", "input_image"]
        body["input"] = data.draw(st.lists(_typed(kinds), max_size=3))
    try:
        responses_api.to_chat(responses_api.parse_request(body))
    except OpenAIError as exc:
        assert exc.status == 400 and exc.param
