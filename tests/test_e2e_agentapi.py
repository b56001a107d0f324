"""End to end through one prefill and one decode node with the official `anthropic` and `openai` packages:
Anthropic's Messages API (messages, stop sequences, streaming, count_tokens, errors, `x-api-key`), OpenAI's
Responses API (text, streaming, the stateless refusals), /tokenize and /detokenize, logit_bias through P
and D, echo, chat_template_kwargs, and the reasoning parser wired into the chat path. One real cluster
(redis-server, a router with an API key and `--reasoning-parser qwen3`, SmolLM2 on CPU) serves the module;
scenarios end with both pools audited back to empty.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx2
import openai
import pytest
from openai.types.responses import Response
from pdserve.shared.model.loader import load_tokenizer
from pdserve.tests.harness import cluster_fixture

pytestmark = pytest.mark.slow

MODEL = cluster_fixture.served_model_name()
KEY = "agent-api-key-1"
AUTH = {"authorization": f"Bearer {KEY}"}
QUESTION: Any = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.fixture(scope="module")
def live() -> Iterator[cluster_fixture.LiveCluster]:
    keys = cluster_fixture.secret_file(KEY)
    with cluster_fixture.LiveCluster.start(
        cluster_fixture.up_config(router_args=("--api-keys-file", keys, "--reasoning-parser", "qwen3"))
    ) as c:
        yield c


@pytest.fixture(scope="module")
def claude(live: cluster_fixture.LiveCluster) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=live.base, api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def oai(live: cluster_fixture.LiveCluster) -> Iterator[openai.OpenAI]:
    with live.openai(KEY) as c:
        yield c


def test_anthropic_messages_multi_turn_and_stop_sequence(
    live: cluster_fixture.LiveCluster, claude: anthropic.Anthropic
) -> None:
    turns: Any = [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello. How can I help?"}]},
        {"role": "user", "content": "Name three colours."},
    ]
    msg = claude.messages.create(
        model=MODEL, system="You are brief.", messages=turns, max_tokens=12, extra_body={"temperature": 0}
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "text"
    text = msg.content[0].text
    assert text and msg.stop_reason in ("max_tokens", "end_turn") and msg.usage.output_tokens <= 12
    words = text.split()
    assert len(words) >= 3, text
    stop = " " + words[2]
    cut = claude.messages.create(
        model=MODEL,
        system="You are brief.",
        messages=turns,
        max_tokens=12,
        extra_body={"temperature": 0},
        stop_sequences=[stop],
    )
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert cut.content[0].type == "text" and cut.content[0].text == text[: text.index(stop)]
    live.wait_clean()


def test_anthropic_stream_events_add_up_to_the_message(
    live: cluster_fixture.LiveCluster, claude: anthropic.Anthropic
) -> None:
    msg = claude.messages.create(model=MODEL, messages=QUESTION, max_tokens=10, extra_body={"temperature": 0})
    kinds = []
    with claude.messages.stream(
        model=MODEL, messages=QUESTION, max_tokens=10, extra_body={"temperature": 0}
    ) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_delta" in kinds and "message_delta" in kinds
    assert final.content[0].type == "text" and msg.content[0].type == "text"
    assert final.content[0].text == msg.content[0].text
    assert final.stop_reason == msg.stop_reason and final.usage.output_tokens == msg.usage.output_tokens
    raw = httpx2.post(
        f"{live.base}/v1/messages",
        headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
        json={"model": MODEL, "messages": QUESTION, "max_tokens": 10, "temperature": 0, "stream": True},
        timeout=120,
    ).text
    events = [line.removeprefix("event: ") for line in raw.splitlines() if line.startswith("event: ")]
    assert events[:3] == ["message_start", "content_block_start", "ping"], events
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"], events
    started = json.loads(
        next(line for line in raw.splitlines() if line.startswith("data: ")).removeprefix("data: ")
    )
    prompt = msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)
    assert started["message"]["usage"]["input_tokens"] == prompt > 5
    live.wait_clean()


def test_anthropic_count_tokens_equals_the_messages_input(claude: anthropic.Anthropic) -> None:
    msg = claude.messages.create(
        model=MODEL, system="Be brief.", messages=QUESTION, max_tokens=2, extra_body={"temperature": 0}
    )
    counted = claude.messages.count_tokens(model=MODEL, system="Be brief.", messages=QUESTION)
    assert counted.input_tokens == msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) > 5


def test_anthropic_errors_in_anthropic_shape(
    live: cluster_fixture.LiveCluster, claude: anthropic.Anthropic
) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model=MODEL, messages=QUESTION, max_tokens=5, extra_body={"temperature": 1.5})
    assert bad.value.status_code == 400 and "temperature" in str(bad.value.body)
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-nonexistent", messages=QUESTION, max_tokens=5)
    stranger = anthropic.Anthropic(base_url=live.base, api_key="wrong-key", max_retries=0)
    with stranger, pytest.raises(anthropic.AuthenticationError):
        stranger.messages.create(model=MODEL, messages=QUESTION, max_tokens=5)
    r = httpx2.post(
        f"{live.base}/v1/messages", headers=AUTH, json={"model": MODEL, "messages": QUESTION}, timeout=30
    )
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]


def test_anthropic_client_leaving_mid_stream_frees_the_nodes(live: cluster_fixture.LiveCluster) -> None:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 400, "stream": True, "temperature": 0}
    with httpx2.stream(
        "POST", f"{live.base}/v1/messages", headers={"x-api-key": KEY}, json=body, timeout=120
    ) as r:
        assert r.status_code == 200
        deltas = 0
        for line in r.iter_lines():
            deltas += line == "event: content_block_delta"
            if deltas == 2:
                break
    live.wait_clean()


def test_anthropic_tool_use_round_trip(claude: anthropic.Anthropic) -> None:
    tools: Any = [{"name": "weather", "description": "The weather in a city", "input_schema": WEATHER}]
    ask: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = claude.messages.create(
        model=MODEL,
        messages=ask,
        tools=tools,
        tool_choice={"type": "tool", "name": "weather"},
        max_tokens=60,
        extra_body={"temperature": 0},
    )
    use = next(b for b in first.content if b.type == "tool_use")
    assert first.stop_reason == "tool_use" and use.name == "weather" and isinstance(use.input, dict)
    turns: Any = [
        *ask,
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21C, sunny"}],
        },
    ]
    final = claude.messages.create(
        model=MODEL, messages=turns, tools=tools, max_tokens=30, extra_body={"temperature": 0}
    )
    assert final.content and final.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_responses_text_and_stream(live: cluster_fixture.LiveCluster, oai: openai.OpenAI) -> None:
    resp = oai.responses.create(
        model=MODEL,
        input="What is the capital of France?",
        instructions="Be brief.",
        max_output_tokens=10,
        temperature=0,
        store=False,
    )
    assert resp.object == "response" and resp.status in ("completed", "incomplete") and resp.output_text
    assert resp.usage is not None and resp.usage.output_tokens <= 10
    raw = httpx2.post(
        f"{live.base}/v1/responses",
        headers=AUTH,
        timeout=120,
        json={
            "model": MODEL,
            "input": "What is the capital of France?",
            "instructions": "Be brief.",
            "max_output_tokens": 10,
            "temperature": 0,
        },
    ).json()
    assert Response.model_validate(raw).output_text == resp.output_text and raw["store"] is False
    kinds, text = [], ""
    with oai.responses.stream(
        model=MODEL,
        input="What is the capital of France?",
        instructions="Be brief.",
        max_output_tokens=10,
        temperature=0,
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    for k in (
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ):
        assert k in kinds
    assert text == final.output_text == resp.output_text
    live.wait_clean()


def test_responses_stateless_and_bad_input_are_400(
    live: cluster_fixture.LiveCluster, oai: openai.OpenAI
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(model=MODEL, input="hi", previous_response_id="resp_123")
    assert "stores no responses" in str(info.value)
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model=MODEL, input=[{"type": "input_image", "image_url": "x"}])  # type: ignore[list-item]
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve("resp_123")
    r = httpx2.post(f"{live.base}/v1/responses", headers=AUTH, json={"model": MODEL}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"


def test_responses_function_tool_round_trip(oai: openai.OpenAI) -> None:
    tools: Any = [
        {"type": "function", "name": "weather", "description": "The weather in a city", "parameters": WEATHER}
    ]
    first = oai.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=tools,
        tool_choice="required",
        max_output_tokens=60,
        temperature=0,
    )
    call = next(o for o in first.output if o.type == "function_call")
    assert call.name == "weather" and "city" in json.loads(call.arguments)
    items: Any = [
        {"role": "user", "content": "What is the weather in Paris?"},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "21C, sunny"},
    ]
    final = oai.responses.create(model=MODEL, input=items, tools=tools, max_output_tokens=30, temperature=0)
    assert final.output_text


def test_tokenize_round_trip(live: cluster_fixture.LiveCluster) -> None:
    tok = load_tokenizer(cluster_fixture.model_path())
    text = "Tokenize me, please: 1 + 1 = 2."
    r = httpx2.post(
        f"{live.base}/tokenize", headers=AUTH, json={"model": MODEL, "prompt": text}, timeout=30
    ).json()
    assert r["tokens"] == tok.encode(text, add_special_tokens=True) and r["count"] == len(r["tokens"])
    models = httpx2.get(f"{live.base}/v1/models", headers=AUTH, timeout=30).json()
    assert r["max_model_len"] == models["data"][0]["max_model_len"]
    back = httpx2.post(
        f"{live.base}/detokenize", headers=AUTH, json={"tokens": r["tokens"]}, timeout=30
    ).json()
    assert back["prompt"] == tok.decode(r["tokens"], skip_special_tokens=False) and text in back["prompt"]
    chat = httpx2.post(f"{live.base}/tokenize", headers=AUTH, json={"messages": QUESTION}, timeout=30).json()
    done = httpx2.post(
        f"{live.base}/v1/chat/completions",
        headers=AUTH,
        timeout=60,
        json={"model": MODEL, "messages": QUESTION, "max_tokens": 1},
    ).json()
    assert chat["count"] == done["usage"]["prompt_tokens"]
    for path, body, param in (
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/tokenize", {"prompt": "x", "model": "nope"}, "model"),
    ):
        bad = httpx2.post(f"{live.base}{path}", headers=AUTH, json=body, timeout=30)
        assert bad.status_code in (400, 404) and bad.json()["error"]["param"] == param
    assert httpx2.post(f"{live.base}/tokenize", json={"prompt": "x"}, timeout=30).status_code == 401


def test_logit_bias_holds_on_prefill_and_decode(
    live: cluster_fixture.LiveCluster, oai: openai.OpenAI
) -> None:
    """P samples the first token and D the rest: a +100 bias makes every one of them the biased token."""
    tok = load_tokenizer(cluster_fixture.model_path())
    target = tok.encode(" banana")[0]
    comp = oai.completions.create(
        model=MODEL,
        prompt="My favourite fruit is",
        max_tokens=4,
        temperature=0,
        logit_bias={str(target): 100},
    )
    assert comp.choices[0].text == tok.decode([target] * 4)
    plain = oai.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=3, temperature=0, logprobs=True
    )
    assert plain.choices[0].logprobs is not None and plain.choices[0].logprobs.content
    first = tok.encode(plain.choices[0].logprobs.content[0].token)[0]
    banned = oai.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=3,
        temperature=0,
        logprobs=True,
        logit_bias={str(first): -100},
    )
    assert banned.choices[0].logprobs is not None and banned.choices[0].logprobs.content
    assert banned.choices[0].logprobs.content[0].token != plain.choices[0].logprobs.content[0].token
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        oai.completions.create(model=MODEL, prompt="x", max_tokens=1, logit_bias={"99999999": 1})
    live.wait_clean()


def test_echo_and_echo_with_logprobs(oai: openai.OpenAI) -> None:
    comp = oai.completions.create(model=MODEL, prompt="One, two,", max_tokens=3, temperature=0, echo=True)
    assert comp.choices[0].text.startswith("One, two,")
    with pytest.raises(openai.BadRequestError, match="prompt tokens' logprobs"):
        oai.completions.create(model=MODEL, prompt="One", max_tokens=3, echo=True, logprobs=1)


def test_reasoning_parser_and_template_kwargs_on_the_chat_path(
    live: cluster_fixture.LiveCluster, oai: openai.OpenAI
) -> None:
    """SmolLM2 does not think: with --reasoning-parser qwen3 wired in, its answer stays whole content, and a
    stream's deltas add up to it (tests/test_router_reasoning.py covers the split itself)."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": QUESTION,
        "max_tokens": 8,
        "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    whole = httpx2.post(f"{live.base}/v1/chat/completions", headers=AUTH, json=body, timeout=60).json()
    message = whole["choices"][0]["message"]
    assert "reasoning_content" in message and message["reasoning_content"] is None and message["content"]
    text = ""
    with httpx2.stream(
        "POST", f"{live.base}/v1/chat/completions", headers=AUTH, json={**body, "stream": True}, timeout=60
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line.removeprefix("data: "))["choices"][0]["delta"]
                assert "reasoning_content" not in delta
                text += delta.get("content") or ""
    assert text == message["content"]
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs may not set"):
        oai.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            max_tokens=2,
            extra_body={"chat_template_kwargs": {"add_generation_prompt": False}},
        )
    live.wait_clean()
