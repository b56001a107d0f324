"""router/openai_protocol.py and openai_builders.py: validation errors in OpenAI's shape, and every response
object validated against OpenAI's published schemas (tests/harness/openai_schema.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pdserve.router.openai_builders import ResponseHead, models_response, usage
from pdserve.router.openai_protocol import OpenAIError, parse_chat, parse_completion
from pdserve.shared.engine.sampling_params import Constraint
from pdserve.shared.node.node_protocol import TokenLogprob, TopLogprob
from pdserve.tests.harness import openai_schema

validate = openai_schema.validate

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "Once upon"}


def refused(parse: Any, body: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        parse(body)
    err = info.value
    validate(err.body(), "ErrorResponse")
    return err


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content",
        ),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].function.parameters"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        ({"guided_regex": "(("}, "guided_regex"),
        ({"guided_json": {"type": 5}}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"xml": "x"}}, "structured_outputs.xml"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 2**64 - 1, "n": 2}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"logit_bias": {"five": 10}}, "logit_bias"),
        ({"logit_bias": {"²": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"5": 1, "05": 2}}, "logit_bias"),
        ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
        ({"model": None}, "model"),
        ({"top_k": -3}, "top_k"),
    ],
)
def test_bad_chat_parameters_are_400_naming_the_parameter(patch: dict[str, Any], param: str) -> None:
    err = refused(parse_chat, {**CHAT, **patch})
    assert err.status == 400 and err.type == "invalid_request_error"
    assert err.param == param, err.message


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"prompt": 5}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, -4]}, "prompt"),
        ({"prompt": ["a", 3]}, "prompt"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"best_of": 3}, "best_of"),
        ({"suffix": "end"}, "suffix"),
    ],
)
def test_bad_completion_parameters_are_400(patch: dict[str, Any], param: str) -> None:
    err = refused(parse_completion, {**COMPLETION, **patch})
    assert (err.status, err.param) == (400, param), err.message


def test_logit_bias_and_chat_template_kwargs_reach_the_spec() -> None:
    spec = parse_chat({**CHAT, "logit_bias": {"5": 10, "17": -100.0}})
    assert spec.sampling.logit_bias == ((5, 10.0), (17, -100.0))
    spec = parse_chat({**CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    assert spec.tokenize.template_kwargs == {"enable_thinking": False}
    assert parse_completion({**COMPLETION, "logit_bias": {"3": 1}}).sampling.logit_bias == ((3, 1.0),)
    assert (
        "prompt tokens' logprobs"
        in refused(parse_completion, {**COMPLETION, "echo": True, "logprobs": 0}).message
    )


def test_missing_prompt_and_non_object_body() -> None:
    assert refused(parse_completion, {"model": "m"}).param == "prompt"
    assert refused(parse_chat, ["not", "an", "object"]).status == 400


def test_chat_spec_maps_openai_fields() -> None:
    spec = parse_chat(
        {
            **CHAT,
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None},
            ],
            "max_tokens": 99,
            "max_completion_tokens": 7,
            "logprobs": True,
            "top_logprobs": 3,
            "stop": "END",
            "seed": 11,
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": "someone",
            "some_future_field": {"x": 1},
            "cache_salt": "tenant-a",
        }
    )
    assert spec.messages == (
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": ""},
    )
    assert spec.max_tokens == 7 and spec.n == 2 and spec.stream and spec.include_usage
    assert spec.sampling.logprobs == 3 and spec.sampling.stop == ("END",) and spec.cache_salt == "tenant-a"
    assert [spec.sampling_for(7, j).seed for j in range(2)] == [11, 12]
    assert spec.sampling_for(7, 1).max_tokens == 7
    assert parse_chat(CHAT).max_tokens is None and parse_chat(CHAT).sampling.logprobs is None


def test_completion_prompt_forms() -> None:
    assert parse_completion(COMPLETION).prompts == ("Once upon",)
    assert parse_completion(COMPLETION).max_tokens == 16  # OpenAI's default for completions
    assert parse_completion({**COMPLETION, "prompt": [1, 2]}).prompts == ((1, 2),)
    assert parse_completion({**COMPLETION, "prompt": ["a", "b"]}).prompts == ("a", "b")
    assert parse_completion({**COMPLETION, "prompt": [[1], [2, 3]]}).prompts == ((1,), (2, 3))
    unseeded = parse_completion({**COMPLETION, "n": 3, "logprobs": 0})
    assert unseeded.sampling_for(5, 2).seed is None and unseeded.sampling.logprobs == 0


HEAD_CHAT = ResponseHead("chat", "chatcmpl-1", 1700000000, "m", "fp_abc")
HEAD_CMPL = ResponseHead("completion", "cmpl-1", 1700000000, "m", "fp_abc")
LPS = [
    TokenLogprob(
        5, "Hi", -0.1, (72, 105), (TopLogprob("Hi", 5, -0.1, (72, 105)), TopLogprob("Yo", 9, -2.5, None))
    ),
    TokenLogprob(6, "!", -9999.0, (33,), ()),
]


def test_chat_response_and_chunks_match_schemas() -> None:
    u = usage(12, 2, 8)
    body = HEAD_CHAT.response(
        [HEAD_CHAT.choice(1, "Hi!", "stop", None), HEAD_CHAT.choice(0, "Hi!", "length", LPS)], u
    )
    validate(body, "CreateChatCompletionResponse")
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert (
        body["usage"]["prompt_tokens_details"]["cached_tokens"] == 8 and body["usage"]["total_tokens"] == 14
    )
    assert body["choices"][0]["logprobs"]["content"][0]["top_logprobs"][1] == {
        "token": "Yo",
        "logprob": -2.5,
        "bytes": None,
    }
    chunks = [
        HEAD_CHAT.chunk(0, "", None, None, True, role=True),
        HEAD_CHAT.chunk(0, "Hi", None, LPS[:1], True),
        HEAD_CHAT.chunk(0, "", "stop", None, True),
        HEAD_CHAT.usage_chunk(u),
        HEAD_CHAT.chunk(0, "x", None, None, False),
    ]
    for chunk in chunks:
        validate(chunk, "CreateChatCompletionStreamResponse")
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[2]["choices"][0]["delta"] == {} and chunks[0]["usage"] is None
    assert chunks[3]["choices"] == [] and "usage" not in chunks[4]


def test_completion_response_and_chunks_match_schemas() -> None:
    body = HEAD_CMPL.response([HEAD_CMPL.choice(0, "Say: Hi!", "length", LPS, offset=5)], usage(3, 2, 0))
    validate(body, "CreateCompletionResponse")
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["Hi", "!"] and lp["text_offset"] == [5, 7]
    assert lp["top_logprobs"] == [{"Hi": -0.1, "Yo": -2.5}, {}]
    for chunk in (HEAD_CMPL.chunk(0, "Hi", None, LPS[:1], False), HEAD_CMPL.chunk(0, "", "stop", None, True)):
        validate(chunk, "CreateCompletionResponse", streamed_completion=True)
    validate(HEAD_CMPL.usage_chunk(usage(3, 2, 0)), "CreateCompletionResponse")


def test_models_and_errors_match_schemas() -> None:
    validate(models_response(["SmolLM2"], 1700000000, 8192), "ListModelsResponse")
    validate(models_response(["SmolLM2"], 1700000000, None), "ListModelsResponse")
    validate(OpenAIError(503, "no serving node", "server_error", code="no_nodes").body(), "ErrorResponse")


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    ("patch", "kind", "spec"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", ""),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            },
            "json_schema",
            json.dumps(SCHEMA),
        ),
        ({"guided_json": SCHEMA}, "json_schema", json.dumps(SCHEMA)),
        ({"guided_json": json.dumps(SCHEMA)}, "json_schema", json.dumps(SCHEMA)),
        ({"guided_regex": "[a-z]+"}, "regex", "[a-z]+"),
        ({"guided_choice": ["yes", "no"]}, "choice", '["yes", "no"]'),
        ({"guided_grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
        ({"structured_outputs": {"json": SCHEMA}}, "json_schema", json.dumps(SCHEMA)),
        ({"structured_outputs": {"regex": "a+"}}, "regex", "a+"),
        ({"structured_outputs": {"choice": ["a"]}}, "choice", '["a"]'),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "grammar", 'root ::= "a"'),
        ({"ebnf": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
    ],
)
def test_structured_output_fields_become_one_constraint(patch: dict[str, Any], kind: str, spec: str) -> None:
    for parse, body in ((parse_chat, CHAT), (parse_completion, {"model": "m", "prompt": "x"})):
        constraint = parse({**body, **patch}).sampling.constraint
        assert constraint == Constraint(kind, spec)  # type: ignore[arg-type]
    assert parse_chat({**CHAT, "response_format": {"type": "text"}}).sampling.constraint is None


def test_tool_choice_required_and_named_constrain_and_auto_does_not() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
    auto = parse_chat({**CHAT, "tools": [tool]})
    assert auto.tools is not None and auto.tools.choice == "auto" and auto.sampling.constraint is None
    named = parse_chat(
        {**CHAT, "tools": [tool], "tool_choice": {"type": "function", "function": {"name": "f"}}}
    )
    assert named.sampling.constraint == Constraint("json_schema", json.dumps(SCHEMA))
    required = parse_chat({**CHAT, "tools": [tool], "tool_choice": "required"})
    assert required.sampling.constraint is not None and required.sampling.constraint.kind == "json_schema"
    err = refused(parse_chat, {**CHAT, "tools": [tool], "tool_choice": "required", "guided_regex": "a"})
    assert err.param == "tool_choice"
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    turns = [
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ]
    spec = parse_chat({**CHAT, "messages": [*CHAT["messages"], *turns]})
    assert spec.messages[-2]["tool_calls"] == [call] and spec.messages[-1]["tool_call_id"] == "c1"
