"""End to end through one prefill and one decode node: the official `openai` client, OpenAI's schemas on
every body and stream chunk, P/D output equal to the offline engine (greedy and seeded), OpenAI-style
errors on bad input, and a client that leaves mid-stream. One real cluster (redis-server, router, SmolLM2
on CPU, one torch thread per node) serves the whole module; after every scenario both pools are audited
back to in_use == reserved == 0, and teardown asserts no process is left.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx2
import openai
import pytest
from pdserve.shared.model.loader import load_tokenizer
from pdserve.tests.harness import cluster_fixture
from pdserve.tests.harness import openai_schema as schema

pytestmark = pytest.mark.slow

MODEL = cluster_fixture.served_model_name()
LONG_PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden screw press. Within a few decades, print shops had "
    "spread to more than two hundred cities across Europe, and the cost of books fell sharply. Scholars, "
    "merchants and clergy could now own texts that had once been copied by hand over many months. In a "
    "short paragraph, explain why this mattered for science:"
)


@pytest.fixture(scope="module")
def live() -> Iterator[cluster_fixture.LiveCluster]:
    yield from cluster_fixture.live_cluster()


@pytest.fixture(scope="module")
def client(live: cluster_fixture.LiveCluster) -> Iterator[openai.OpenAI]:
    with live.openai() as c:
        yield c


def sse(live: cluster_fixture.LiveCluster, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The data objects of one streamed response (raw bytes, no client library), up to [DONE]."""
    chunks: list[dict[str, Any]] = []
    with httpx2.stream("POST", f"{live.base}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                return chunks
            chunks.append(json.loads(line.removeprefix("data: ")))
    raise AssertionError(f"stream ended without [DONE] after {len(chunks)} chunks")


def test_openai_client_chat_and_completions(live: cluster_fixture.LiveCluster, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    messages: Any = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content and chat.choices[0].finish_reason in ("length", "stop")
    assert chat.usage is not None and chat.usage.completion_tokens <= 8
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == chat.choices[0].message.content
    comp = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert comp.object == "text_completion" and comp.choices[0].text
    streamed = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == comp.choices[0].text
    live.wait_clean()


def test_every_body_and_chunk_matches_openai_schemas(live: cluster_fixture.LiveCluster) -> None:
    chat: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    r = httpx2.post(f"{live.base}/v1/chat/completions", json=chat, timeout=120)
    assert r.status_code == 200, r.text
    schema.validate(r.json(), "CreateChatCompletionResponse")
    chunks = sse(
        live, "/v1/chat/completions", chat | {"stream": True, "stream_options": {"include_usage": True}}
    )
    assert chunks and chunks[-1]["usage"]["completion_tokens"] >= 1
    for chunk in chunks:
        schema.validate(chunk, "CreateChatCompletionStreamResponse")
    comp = {"model": MODEL, "prompt": "Colours: red,", "max_tokens": 6, "temperature": 0, "logprobs": 2}
    r = httpx2.post(f"{live.base}/v1/completions", json=comp, timeout=120)
    assert r.status_code == 200, r.text
    schema.validate(r.json(), "CreateCompletionResponse")
    chunks = sse(live, "/v1/completions", comp | {"stream": True})
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    for chunk in chunks:
        schema.validate(chunk, "CreateCompletionResponse", streamed_completion=True)
    models = httpx2.get(f"{live.base}/v1/models", timeout=10).json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    live.wait_clean()


def test_greedy_pd_equals_offline_engine(live: cluster_fixture.LiveCluster) -> None:
    """KV computed on P and shipped to D continues exactly as on one engine: same tokens, same logprobs."""
    offline = cluster_fixture.generate_offline(
        "--prompt", LONG_PROMPT, "--max-tokens", "24", "--logprobs", "0"
    )
    assert len(offline["prompt_token_ids"]) > 64, "the prompt must span several KV blocks"
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 24, "temperature": 0, "logprobs": 0}
    r = httpx2.post(f"{live.base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["prompt_tokens"] == len(offline["prompt_token_ids"])
    assert out["usage"]["completion_tokens"] == len(offline["token_ids"])
    assert out["choices"][0]["text"] == offline["text"]
    served_lps = out["choices"][0]["logprobs"]["token_logprobs"]
    offline_lps = [lp["logprob"] for lp in offline["logprobs"]]
    assert served_lps == pytest.approx(offline_lps, abs=1e-3)
    streamed = sse(live, "/v1/completions", body | {"stream": True, "logprobs": None})
    assert "".join(c["choices"][0]["text"] for c in streamed) == offline["text"]
    live.wait_clean()


def test_seeded_sampling_pd_equals_offline_engine(live: cluster_fixture.LiveCluster) -> None:
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    offline = cluster_fixture.generate_offline(
        "--messages",
        json.dumps(messages),
        "--max-tokens",
        "20",
        "--temperature",
        "0.8",
        "--sampling-seed",
        "1234",
    )
    body = {"model": MODEL, "messages": messages, "max_tokens": 20, "temperature": 0.8, "seed": 1234}
    r = httpx2.post(f"{live.base}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == offline["text"]
    chunks = sse(live, "/v1/chat/completions", body | {"stream": True})
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == offline["text"]
    live.wait_clean()


BAD_REQUESTS = [
    ("malformed json", "/v1/chat/completions", b'{"model": "x", "messages": [', 400, None),
    (
        "unknown model",
        "/v1/chat/completions",
        {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},
        404,
        "model",
    ),
    (
        "temperature -1",
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "temperature": -1},
        400,
        "temperature",
    ),
    ("max_tokens 0", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (
        "top_p 2",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 2},
        400,
        "top_p",
    ),
    ("n 0", "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
    (
        "prompt over the context",
        "/v1/completions",
        {"model": MODEL, "prompt": "hello " * 9000, "max_tokens": 4},
        400,
        "prompt",
    ),
]


def test_min_tokens_holds_back_a_stop_token_from_prefill_to_decode(live: cluster_fixture.LiveCluster) -> None:
    """The first token is sampled on P, the rest on D: min_tokens must hold a stop token back on both."""
    tokenizer = load_tokenizer(cluster_fixture.model_path())
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}
    first = httpx2.post(f"{live.base}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    (stop_id,) = tokenizer.encode(first, False)
    body |= {"max_tokens": 6, "stop_token_ids": [stop_id]}
    stopped = httpx2.post(f"{live.base}/v1/completions", json=body, timeout=120).json()
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["choices"][0]["text"] == ""
    for stream in (False, True):
        asked = body | {"min_tokens": 3, "stream": stream}
        if stream:
            chunks = sse(live, "/v1/completions", asked)
            for chunk in chunks:
                schema.validate(chunk, "CreateCompletionResponse", streamed_completion=True)
            text = "".join(c["choices"][0]["text"] for c in chunks)
        else:
            r = httpx2.post(f"{live.base}/v1/completions", json=asked, timeout=120)
            assert r.status_code == 200, r.text
            schema.validate(r.json(), "CreateCompletionResponse")
            assert r.json()["usage"]["completion_tokens"] >= 3
            text = r.json()["choices"][0]["text"]
        ids = tokenizer.encode(text, False)
        assert len(ids) >= 3 and stop_id not in ids[:3], (text, ids)
    live.wait_clean()


def test_chat_options_through_the_openai_client(client: openai.OpenAI) -> None:
    turns: Any = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue is a"},
    ]
    cont = client.chat.completions.create(
        model=MODEL, messages=turns, max_tokens=4, temperature=0, extra_body={"continue_final_message": True}
    )
    schema.validate(cont.model_dump(mode="json", exclude_unset=True), "CreateChatCompletionResponse")
    fresh = client.chat.completions.create(model=MODEL, messages=turns, max_tokens=4, temperature=0)
    assert cont.usage is not None and fresh.usage is not None
    assert cont.usage.prompt_tokens < fresh.usage.prompt_tokens  # no end-of-turn, no new assistant header
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=MODEL, messages=turns, max_tokens=4, extra_body={"guided_whitespace_pattern": " "}
        )
    assert "`guided_whitespace_pattern` is not supported by this server" in str(exc.value)


@pytest.mark.parametrize(
    ("path", "body", "status", "param"), [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS]
)
def test_bad_input_gets_openai_errors(
    live: cluster_fixture.LiveCluster, path: str, body: bytes | dict[str, Any], status: int, param: str | None
) -> None:
    if isinstance(body, bytes):
        r = httpx2.post(f"{live.base}{path}", content=body, headers={"content-type": "application/json"})
    else:
        r = httpx2.post(f"{live.base}{path}", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()
    schema.validate(err, "ErrorResponse")
    assert err["error"]["message"]
    if param is not None:
        assert err["error"]["param"] == param, err
    if param == "prompt":
        assert err["error"]["code"] == "context_length_exceeded"
    live.wait_clean(timeout_s=10)


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, top_p=2)
    assert exc.value.status_code == 400


def _generated(live: cluster_fixture.LiveCluster) -> float:
    return live.metric("decode-0", "pdserve_node_generation_tokens_total")


@pytest.mark.parametrize("leave_after_chunks", [3, 0], ids=["while-decoding", "while-prefilling"])
def test_client_disconnect_frees_blocks(live: cluster_fixture.LiveCluster, leave_after_chunks: int) -> None:
    """A client that goes away mid-stream (or before its first token) frees every block on P and D."""
    prompt = LONG_PROMPT * (1 if leave_after_chunks else 4)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 400, "temperature": 0, "stream": True}
    before = _generated(live)
    with httpx2.stream("POST", f"{live.base}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        if leave_after_chunks:
            lines = r.iter_lines()
            got = 0
            while got < leave_after_chunks:
                got += next(lines).startswith("data: ")
        else:
            time.sleep(0.3)
    live.wait_clean(timeout_s=60)
    generated = _generated(live) - before
    assert generated < 400, f"decode ran to max_tokens ({generated} tokens) after the client left"
