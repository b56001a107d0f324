"""Tool-call parsing (router/tool_calls.py), pure text in, OpenAI tool_calls out: every format whole and
streamed piece by piece, where the streamed arguments must concatenate to the whole parse's; plus the
plan's checks (a tool without a schema, a bad schema, a named tool that is not listed: 400 naming it)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pdserve.router.openai_errors import OpenAIError
from pdserve.router.tool_calls import ToolCallStream, parse_plan, parse_tool_calls, template_input

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def streamed(fmt: Any, text: str, name: str | None = None, step: int = 3) -> tuple[str, list[dict[str, Any]]]:
    """Feeds `text` in pieces of `step` characters; returns the streamed content and the calls rebuilt from
    the deltas (arguments concatenated)."""
    parser = ToolCallStream(fmt, name)
    content, calls = "", dict[int, dict[str, Any]]()
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for out in [*(parser.feed(p) for p in pieces), parser.finish()]:
        content += out[0]
        for d in out[1]:
            call = calls.setdefault(d["index"], {"name": None, "arguments": "", "id": None})
            if "id" in d:
                assert call["id"] is None, "a call's id and name come once"
                call["id"], call["name"] = d["id"], d["function"]["name"]
            call["arguments"] += d["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_hermes_calls_between_content_whole_and_streamed(step: int) -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris \\"FR\\"", "d": [1, {"x": "}"}]}}\n</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    )
    content, calls = parse_tool_calls("hermes", text)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_weather"]
    args = [json.loads(c["function"]["arguments"]) for c in calls]
    assert args == [{"city": 'Paris "FR"', "d": [1, {"x": "}"}]}, {"city": "Rome"}]
    s_content, s_calls = streamed("hermes", text, step=step)
    assert s_content.strip() == "Let me check."
    assert [c["arguments"] for c in s_calls] == [c["function"]["arguments"] for c in calls]
    assert all(c["id"].startswith("call_") for c in s_calls)


def test_hermes_plain_text_and_broken_call_stay_content() -> None:
    assert parse_tool_calls("hermes", "Hello <tool") == ("Hello <tool", [])
    assert streamed("hermes", "Hello <tool")[0] == "Hello <tool"
    broken = "<tool_call>{not json}</tool_call>"
    assert parse_tool_calls("hermes", broken) == (broken, [])


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_required_array_and_named_whole_and_streamed(step: int) -> None:
    text = '[{"name": "a", "arguments": {"q": "x]"}}, {"name": "b", "arguments": {}}]'
    content, calls = parse_tool_calls("required", text)
    assert content is None and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("a", '{"q": "x]"}'),
        ("b", "{}"),
    ]
    assert [(c["name"], c["arguments"]) for c in streamed("required", text, step=step)[1]] == [
        ("a", '{"q": "x]"}'),
        ("b", "{}"),
    ]
    named = '{"city": "Oslo"}'
    assert parse_tool_calls("named", named, "get_weather")[1][0]["function"] == {
        "name": "get_weather",
        "arguments": named,
    }
    s = streamed("named", named, "get_weather", step)[1]
    assert [(c["name"], c["arguments"]) for c in s] == [("get_weather", named)]


def test_llama3_json() -> None:
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima"}}'
    content, calls = parse_tool_calls("llama3_json", text)
    assert content is None and calls[0]["function"]["arguments"] == '{"city": "Lima"}'
    assert parse_tool_calls("llama3_json", "Just text.") == ("Just text.", [])


def test_plan_refusals_name_the_problem() -> None:
    no_schema = {"type": "function", "function": {"name": "f"}}
    with pytest.raises(OpenAIError, match=r"tools\[0\].function.parameters is missing") as e:
        parse_plan({"tools": [no_schema]})
    assert e.value.status == 400 and e.value.param == "tools[0].function.parameters"
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}
    with pytest.raises(OpenAIError, match="does not compile"):
        parse_plan({"tools": [bad]})
    with pytest.raises(OpenAIError, match="not in tools"):
        parse_plan({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    with pytest.raises(OpenAIError, match="needs at least one tool"):
        parse_plan({"tool_choice": "required"})
    assert parse_plan({"tools": [WEATHER], "tool_choice": "none"}) is None
    plan = parse_plan({"tools": [WEATHER], "parallel_tool_calls": False, "tool_choice": "required"})
    assert plan is not None and plan.constraint() is not None
    assert json.loads(plan.constraint().spec)["maxItems"] == 1  # type: ignore[union-attr]


def test_template_input_without_native_tools_renders_the_tool_prompt_and_turns() -> None:
    plan = parse_plan({"tools": [WEATHER]})
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    out, tools = template_input(messages, plan, "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert tools is None and out[0]["role"] == "system" and "get_weather" in out[0]["content"]
    assert (
        out[2]["content"]
        == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    assert out[3] == {"role": "tool", "content": "<tool_response>\nsunny\n</tool_response>"}
    native, tools = template_input(messages, plan, "{% if tools %}...{% endif %}")
    assert tools == [WEATHER] and native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
