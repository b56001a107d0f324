"""Structured output and tool calling end to end through one prefill and one decode node (SmolLM2 on CPU),
with the official `openai` client: `chat.completions.parse` with a pydantic model on 20 concurrent prompts,
json_schema output checked with `jsonschema`, regex / choice / grammar constraints with n > 1, stop strings
and max_tokens, tool_choice "required" and a named tool (streamed and not) whose arguments validate against
the tool's schema, a tool round trip, the P/D output equal to the offline engine's under the same grammar
(P samples the first token under the mask, D replays it), OpenAI's schemas on every body and chunk, and a
constrained stream the client leaves: every scenario ends with both nodes audited clean (no block, request
or grammar matcher left). One cluster serves the module.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import httpx2
import jsonschema
import openai
import pytest
from pdserve.tests.harness import openai_schema as schema
from pdserve.tests.harness.cluster_fixture import LiveCluster, reference_texts, served_model_name, up_config
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow

MODEL = served_model_name()
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population_millions", "capital"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK_WEATHER: Any = [{"role": "user", "content": "What is the weather like in Paris today?"}]


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    city: Literal["Paris", "London", "Rome", "Tokyo"]


@pytest.fixture(scope="module")
def live() -> Iterator[LiveCluster]:
    with LiveCluster.start(up_config()) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def client(live: LiveCluster) -> Iterator[openai.OpenAI]:
    with live.openai(timeout=300) as c:
        yield c


def post(live: LiveCluster, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx2.post(f"{live.base}/v1/chat/completions", json={"model": MODEL, **body}, timeout=300)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    schema.validate(out, "CreateChatCompletionResponse")
    return out


def stream(live: LiveCluster, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chunks of one streamed chat completion, each validated against OpenAI's chunk schema."""
    chunks: list[dict[str, Any]] = []
    payload = {"model": MODEL, **body, "stream": True}
    with httpx2.stream("POST", f"{live.base}/v1/chat/completions", json=payload, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line:
                continue
            if line == "data: [DONE]":
                return chunks
            chunk = json.loads(line.removeprefix("data: "))
            schema.validate(chunk, "CreateChatCompletionStreamResponse")
            chunks.append(chunk)
    raise AssertionError(f"stream ended without [DONE] after {len(chunks)} chunks")


def streamed_calls(chunks: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]], str | None]:
    """(content, tool calls rebuilt from delta.tool_calls, finish_reason) of choice 0."""
    content, calls, finish = "", dict[int, dict[str, Any]](), None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for d in delta.get("tool_calls") or []:
                call = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
                if d.get("id"):
                    call["id"], call["name"] = d["id"], d["function"]["name"]
                call["arguments"] += d["function"].get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_parse_with_a_pydantic_model_on_20_concurrent_prompts(
    live: LiveCluster, client: openai.OpenAI
) -> None:
    people = ["a scientist", "a painter", "a chef", "a pilot", "a poet", "a doctor", "a farmer", "a singer",
              "a sailor", "a teacher"]  # fmt: skip
    prompts = [f"Describe {p} from {c} as JSON." for p in people for c in ("Paris", "Tokyo")]

    def ask(prompt: str) -> Person:
        done = client.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            response_format=Person,
            max_tokens=80,
            temperature=0.7,
            seed=len(prompt),
        )
        choice = done.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Person)
        return choice.message.parsed

    with ThreadPoolExecutor(len(prompts)) as pool:
        parsed = list(pool.map(ask, prompts))
    assert len(parsed) == 20 and all(0 <= p.age <= 120 for p in parsed)
    live.wait_clean()


def test_json_schema_validates_streamed_and_not(live: LiveCluster) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    messages = [{"role": "user", "content": "Tell me about Rome as JSON."}]
    body = {"messages": messages, "response_format": fmt, "max_tokens": 60, "temperature": 0}
    whole = post(live, body)["choices"][0]
    jsonschema.validate(json.loads(whole["message"]["content"]), CITY)
    assert whole["finish_reason"] == "stop"
    content, calls, finish = streamed_calls(stream(live, body))
    assert content == whole["message"]["content"] and not calls and finish == "stop"
    obj = post(live, {"messages": messages, "response_format": {"type": "json_object"}, "max_tokens": 60,
                      "temperature": 0})  # fmt: skip
    if obj["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(obj["choices"][0]["message"]["content"]), dict)
    else:  # a JSON object of unbounded strings may run to max_tokens; what came is still its prefix
        assert obj["choices"][0]["message"]["content"].lstrip().startswith("{")
    live.wait_clean()


def test_constrained_pd_output_equals_the_offline_engine(live: LiveCluster) -> None:
    """P samples the first token under the grammar and D replays it into its own matcher: the P/D text is
    the single engine's, greedy, under the same constraint."""
    messages = [{"role": "user", "content": "Tell me about Tokyo as JSON."}]
    spec = json.dumps(CITY)
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    served = post(live, {"messages": messages, "response_format": fmt, "max_tokens": 40, "temperature": 0})
    (offline,) = reference_texts(
        [{"messages": messages, "constraint": {"kind": "json_schema", "spec": spec}, "temperature": 0}], 40
    )
    assert served["choices"][0]["message"]["content"] == offline
    live.wait_clean()


def test_regex_choice_grammar_with_n_stop_and_max_tokens(live: LiveCluster) -> None:
    ask = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    choice = post(live, {"messages": ask, "guided_choice": ["yes", "no", "maybe"], "n": 3, "temperature": 1.0,
                         "seed": 3, "max_tokens": 8})  # fmt: skip
    assert len(choice["choices"]) == 3
    assert {c["message"]["content"] for c in choice["choices"]} <= {"yes", "no", "maybe"}
    phone = r"\+1-[0-9]{3}-[0-9]{3}-[0-9]{4}"
    regex = post(live, {"messages": ask, "structured_outputs": {"regex": phone}, "max_tokens": 30,
                        "temperature": 0.8, "n": 2, "seed": 1})  # fmt: skip
    for c in regex["choices"]:
        assert re.fullmatch(phone, c["message"]["content"]), c
    stopped = post(live, {"messages": ask, "guided_regex": phone, "stop": ["-"], "max_tokens": 30})
    assert (
        stopped["choices"][0]["message"]["content"] == "+1"
        and stopped["choices"][0]["finish_reason"] == "stop"
    )
    cut = post(live, {"messages": ask, "guided_regex": phone, "max_tokens": 3, "temperature": 0})
    text = cut["choices"][0]["message"]["content"]
    assert cut["choices"][0]["finish_reason"] == "length" and "+1-555-123-4567".startswith(text[:2])
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    ebnf = post(live, {"messages": ask, "guided_grammar": grammar, "max_tokens": 12, "temperature": 0})
    assert ebnf["choices"][0]["message"]["content"] in ("The answer is yes.", "The answer is no.")
    live.wait_clean()


def test_bad_constraints_are_400_naming_the_problem(live: LiveCluster) -> None:
    for body, param in (
        ({"guided_regex": "(("}, "guided_regex"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}},
         "response_format.json_schema.schema"),
        ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].function.parameters"),
    ):  # fmt: skip
        r = httpx2.post(f"{live.base}/v1/chat/completions",
                       json={"model": MODEL, "messages": ASK_WEATHER, **body}, timeout=60)  # fmt: skip
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", err
        schema.validate(r.json(), "ErrorResponse")
    live.wait_clean()


def _check_call(call: dict[str, Any], tools: list[dict[str, Any]]) -> None:
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call["name"] in by_name, call
    jsonschema.validate(json.loads(call["arguments"]), by_name[call["name"]])


@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_tool_calls_validate_streamed_and_not(live: LiveCluster, choice: str) -> None:
    tools = [WEATHER, TIME]
    tool_choice: Any = (
        "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    )
    body = {
        "messages": ASK_WEATHER,
        "tools": tools,
        "tool_choice": tool_choice,
        "max_tokens": 80,
        "temperature": 0,
    }
    whole = post(live, body)["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None, whole
    calls = whole["message"]["tool_calls"]
    assert calls and all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    for c in calls:
        _check_call(c["function"], tools)
    if choice == "named":
        assert [c["function"]["name"] for c in calls] == ["get_weather"]
    content, streamed, finish = streamed_calls(stream(live, body))
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls
    ]
    one = post(live, {**body, "parallel_tool_calls": False, "temperature": 1.0, "seed": 5})["choices"][0]
    assert len(one["message"]["tool_calls"]) == 1
    live.wait_clean()


def test_tool_round_trip_with_the_openai_client(live: LiveCluster, client: openai.OpenAI) -> None:
    tools: Any = [WEATHER]
    first = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=tools, tool_choice="required", max_tokens=80, temperature=0
    )
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.tool_calls
    call = message.tool_calls[0]
    assert call.type == "function"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])  # type: ignore[index]
    history: Any = [
        *ASK_WEATHER,
        message.model_dump(mode="json", exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ]
    final = client.chat.completions.create(
        model=MODEL, messages=history, tools=tools, tool_choice="none", max_tokens=30, temperature=0
    )
    schema.validate(final.model_dump(mode="json", exclude_unset=True), "CreateChatCompletionResponse")
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason in ("stop", "length")
    # auto: the prompt lists the tool; whatever the small model answers is read as content or tool calls
    auto = post(live, {"messages": history, "tools": tools, "max_tokens": 30, "temperature": 0})["choices"][0]
    assert auto["finish_reason"] in ("stop", "length", "tool_calls")
    live.wait_clean()


def test_leaving_a_constrained_stream_frees_its_matcher(live: LiveCluster) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long JSON list of words."}],
            "response_format": {"type": "json_object"}, "max_tokens": 400, "temperature": 1.0, "seed": 1,
            "stream": True}  # fmt: skip
    with httpx2.stream("POST", f"{live.base}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = 0
        while got < 4:
            got += next(lines).startswith("data: ")
    audits = live.wait_clean(timeout_s=60)
    assert all(a["grammar_matchers"] == 0 for a in audits.values()), audits
