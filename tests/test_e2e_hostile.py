"""End to end: the public API in front of a real node answers every malformed request with a 4xx OpenAI error,
never a 5xx; API keys are accepted as `Authorization: Bearer <key>` only, each key has its own rate limit
(429 with Retry-After), and a client's `cache_salt` never lets two keys share a block. Behind it, every node
route but health and metrics refuses a caller without the cluster's credential, while the router and kvctl,
which hold it, still serve, drain and evict.

One cluster serves the module: Redis, one node with the real SmolLM2 (role single), a router with three API
keys, and a second router on the same index with a tight per-key rate limit. The property-based run builds
request bodies from OpenAI's published request schemas (openai-schemas.json), mixed with hostile values.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pdserve.cli.up import free_port
from pdserve.router.json_body import MAX_JSON_DEPTH
from pdserve.router.openai_protocol import MAX_STOP_STRINGS
from pdserve.shared.node.node_sign import signed
from pdserve.tests.harness import cluster_fixture
from pdserve.tests.harness import openai_schema as schema
from pdserve.tests.harness.chaos_faults import start_router

pytestmark = pytest.mark.slow

MODEL = cluster_fixture.served_model_name()
KEYS = ("key-alpha", "key-beta", "key-fuzz")
VOCAB = 49152  # SmolLM2's tokenizer
RATE, BURST = 2.0, 3


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[cluster_fixture.LiveCluster, str]]:
    """The cluster (its router takes KEYS) and the base URL of the rate-limited router."""
    keys_file = cluster_fixture.secret_file("\n".join(KEYS))
    keys = ("--api-keys-file", keys_file)
    limits = ("--rate-limit", str(RATE), "--rate-limit-burst", str(BURST))
    with cluster_fixture.LiveCluster.start(
        cluster_fixture.up_config(prefill=0, decode=1, router_args=keys)
    ) as cluster:
        yield cluster, start_router(cluster, "router-limited", free_port(), *keys, *limits)


def post(base: str, path: str, body: bytes | dict[str, Any], key: str | None = KEYS[0]) -> httpx2.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    return httpx2.post(base + path, content=content, headers=headers, timeout=120)


def error_of(r: httpx2.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text[:500]
    schema.validate(r.json(), "ErrorResponse")
    return dict(r.json()["error"])


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


CMPL = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
HOSTILE: list[tuple[str, str, bytes | dict[str, Any], int, str | None]] = [
    # (case, path, body, status, param the error names)
    ("lone surrogate in a prompt", "/v1/completions", b'{"model":"%s","prompt":"a\\ud800b"}', 400, "prompt"),
    ("lone low surrogate in a message", "/v1/chat/completions",
     b'{"model":"%s","messages":[{"role":"user","content":"\\udc00"}]}', 400, "messages[0].content"),
    ("lone surrogate in a stop string", "/v1/completions", {**CMPL, "stop": ["\ud83d"]}, 400, "stop[0]"),
    ("lone surrogate in cache_salt", "/v1/completions", {**CMPL, "cache_salt": "\udfff"}, 400, "cache_salt"),
    ("lone surrogate in a key", "/v1/completions", b'{"model":"%s","prompt":"x","\\ud800":1}', 400, None),
    ("JSON nested 100,000 deep", "/v1/completions",
     b'{"model":"%s","prompt":"x","extra":' + nested(100_000) + b"}", 400, None),
    ("JSON nested past the limit", "/v1/completions",
     b'{"model":"%s","prompt":"x","extra":' + nested(MAX_JSON_DEPTH) + b"}", 400, "extra" + "[0]" * 31),
    ("NaN temperature", "/v1/completions", b'{"model":"%s","prompt":"x","temperature":NaN}', 400, None),
    ("Infinity max_tokens", "/v1/completions", b'{"model":"%s","prompt":"x","max_tokens":Infinity}', 400,
     None),
    ("invalid UTF-8", "/v1/completions", b'{"model":"%s","prompt":"\xff\xfe"}', 400, None),
    ("token id = vocabulary size", "/v1/completions", {**CMPL, "prompt": [1, 2, VOCAB]}, 400, "prompt"),
    ("token id of 2**70", "/v1/completions", {**CMPL, "prompt": [[5], [2**70]]}, 400, "prompt"),
    ("negative token id", "/v1/completions", {**CMPL, "prompt": [3, -1]}, 400, "prompt"),
    ("stop token id outside the vocabulary", "/v1/completions", {**CMPL, "stop_token_ids": [VOCAB]}, 400,
     "stop_token_ids"),
    ("too many stop token ids", "/v1/completions", {**CMPL, "stop_token_ids": list(range(65))}, 400,
     "stop_token_ids"),
    ("too many stop strings", "/v1/completions", {**CMPL, "stop": ["s"] * (MAX_STOP_STRINGS + 1)}, 400,
     "stop"),
    ("a 10,000-character stop string", "/v1/completions", {**CMPL, "stop": "s" * 10_000}, 400, "stop"),
    ("logprobs 21", "/v1/completions", {**CMPL, "logprobs": 21}, 400, "logprobs"),
    ("top_logprobs 1000", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 1000}, 400,
     "top_logprobs"),
    ("n of 10**30", "/v1/completions", {**CMPL, "n": 10**30}, 400, "n"),
    ("n x prompts over max_n", "/v1/completions", {**CMPL, "prompt": ["a"] * 9, "n": 2}, 400, "n"),
    ("max_tokens of 10**30", "/v1/completions", {**CMPL, "max_tokens": 10**30}, 400, "max_tokens"),
    ("seed of 2**80", "/v1/completions", {**CMPL, "seed": 2**80}, 400, "seed"),
    ("prompt over the context", "/v1/completions", {**CMPL, "prompt": [5] * 9000}, 400, "prompt"),
    ("body over max_request_bytes", "/v1/completions", {**CMPL, "prompt": "x" * (9 << 20)}, 413, None),
    ("a role that is a list", "/v1/chat/completions", {**CHAT, "messages": [{"role": [], "content": "x"}]},
     400, "messages"),
    ("a message that is a string", "/v1/chat/completions", {**CHAT, "messages": ["hi"]}, 400, None),
    ("a body that is a list", "/v1/completions", b"[1, 2]", 400, None),
    ("an empty body", "/v1/chat/completions", b"", 400, None),
]  # fmt: skip


@pytest.mark.parametrize(("case", "path", "body", "status", "param"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_input_gets_a_4xx_naming_the_problem(
    live: tuple[cluster_fixture.LiveCluster, str],
    case: str,
    path: str,
    body: bytes | dict[str, Any],
    status: int,
    param: str | None,
) -> None:
    cluster, _ = live
    raw = body.replace(b"%s", MODEL.encode()) if isinstance(body, bytes) else body
    err = error_of(post(cluster.base, path, raw), status)
    if param is not None:
        assert err["param"] == param, err


def test_the_cluster_is_healthy_and_clean_after_hostile_input(
    live: tuple[cluster_fixture.LiveCluster, str],
) -> None:
    cluster, _ = live
    assert post(cluster.base, "/v1/completions", CMPL).status_code == 200
    assert httpx2.get(f"{cluster.base}/health", timeout=10).json()["status"] == "ok"
    cluster.wait_clean(timeout_s=30)


def test_an_api_key_counts_only_as_a_bearer_token(live: tuple[cluster_fixture.LiveCluster, str]) -> None:
    cluster, _ = live
    for header in (KEYS[0], f"Basic {KEYS[0]}", "Bearer", f"Bearer {KEYS[0]}x", f"Bearer{KEYS[0]}"):
        r = httpx2.post(
            f"{cluster.base}/v1/completions", json=CMPL, headers={"authorization": header}, timeout=30
        )
        assert error_of(r, 401)["code"] == "invalid_api_key", header
    assert error_of(post(cluster.base, "/v1/completions", CMPL, key=None), 401)["code"] == "invalid_api_key"
    r = httpx2.get(f"{cluster.base}/v1/models", headers={"authorization": KEYS[0]}, timeout=10)
    assert error_of(r, 401)["code"] == "invalid_api_key"
    for header in (f"Bearer {KEYS[1]}", f"bearer {KEYS[1]}"):
        r = httpx2.post(
            f"{cluster.base}/v1/completions", json=CMPL, headers={"authorization": header}, timeout=60
        )
        assert r.status_code == 200, r.text


def test_each_key_has_its_own_rate_limit(live: tuple[cluster_fixture.LiveCluster, str]) -> None:
    """A bucket of BURST requests refilled at RATE/s per key. The requests are malformed on purpose: a key's
    token is taken before the body is read, so a 400 costs one too, without any model work."""
    _, limited = live
    answers = [post(limited, "/v1/completions", b"{}").status_code for _ in range(BURST)]
    assert answers == [400] * BURST
    r = post(limited, "/v1/completions", b"{}")
    err = error_of(r, 429)
    assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
    assert r.headers["retry-after"] == "1"
    assert post(limited, "/v1/completions", b"{}", key=KEYS[1]).status_code == 400  # another key's bucket
    time.sleep(int(r.headers["retry-after"]))
    assert post(limited, "/v1/completions", CMPL).status_code == 200


def test_same_cache_salt_under_two_keys_shares_no_block(
    live: tuple[cluster_fixture.LiveCluster, str],
) -> None:
    cluster, _ = live
    node = next(iter(cluster.nodes))
    prompt = " ".join(f"Clause {i}: the tenant keeps number {i} in repair." for i in range(12))  # > 4 blocks
    body = {**CMPL, "prompt": prompt, "cache_salt": "shared-salt"}

    def cached(key: str) -> tuple[int, float]:
        hits = cluster.metric(node, "pdserve_node_prefix_hit_tokens_total", {"kind": "local"})
        r = post(cluster.base, "/v1/completions", body, key=key)
        assert r.status_code == 200, r.text
        after = cluster.metric(node, "pdserve_node_prefix_hit_tokens_total", {"kind": "local"})
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"], after - hits

    assert cached(KEYS[0]) == (0, 0)
    first_again = cached(KEYS[0])
    assert first_again[0] >= 64 and first_again[1] == first_again[0]  # the same key and salt: a prefix hit
    assert cached(KEYS[1]) == (0, 0)  # another key with the same cache_salt: nothing shared
    assert cached(KEYS[1])[0] >= 64
    cluster.wait_clean(timeout_s=30)


# The property-based run: request bodies from OpenAI's request schemas, some values made hostile.

_DEEP = "\x00deep\x00"  # replaced by nested(5000) once the body is serialized


def _strategy(node: dict[str, Any], depth: int = 0) -> st.SearchStrategy[Any]:
    """Values matching a JSON Schema node of openai-schemas.json (the subset those schemas use)."""
    components = schema._document()["components"]["schemas"]
    if depth > 8:  # levels of arrays and objects
        return st.none()
    if "$ref" in node:
        return _strategy(components[node["$ref"].rsplit("/", 1)[1]], depth)
    if "allOf" in node:
        parts = [components[p["$ref"].rsplit("/", 1)[1]] if "$ref" in p else p for p in node["allOf"]]
        properties = {k: v for part in parts for k, v in part.get("properties", {}).items()}
        required = [k for part in parts for k in part.get("required", [])]
        return _strategy({"type": "object", "properties": properties, "required": required}, depth)
    for key in ("anyOf", "oneOf"):
        if key in node:
            return st.one_of(*(_strategy(n, depth) for n in node[key]))
    if "enum" in node:
        return st.sampled_from(node["enum"])
    types = node.get("type", "object" if "properties" in node else "any")
    if isinstance(types, list):
        return st.one_of(*(_strategy({**node, "type": t}, depth) for t in types))
    if types == "string":
        return st.text(max_size=min(node.get("maxLength", 24), 24))
    if types == "integer":
        return st.integers(node.get("minimum"), node.get("maximum"))
    if types == "number":
        return st.floats(node.get("minimum"), node.get("maximum"), allow_nan=False, allow_infinity=False)
    if types == "boolean":
        return st.booleans()
    if types == "null":
        return st.none()
    if types == "array":
        items = _strategy(node.get("items", {"type": "any"}), depth + 1)
        return st.lists(items, min_size=node.get("minItems", 0), max_size=max(node.get("minItems", 0), 3))
    if types == "object" and "properties" in node:
        props = {k: _strategy(v, depth + 1) for k, v in node["properties"].items()}
        needed = set(node.get("required", ()))
        return st.fixed_dictionaries(
            {k: v for k, v in props.items() if k in needed},
            optional={k: v for k, v in props.items() if k not in needed},
        )
    return st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
        max_leaves=6,
    )


HOSTILE_VALUES = st.sampled_from(
    [[VOCAB, 1], "\ud800", "a\udc00", _DEEP, 2**70, -(2**70), VOCAB, [VOCAB], [[-1]], 1e308, -0.0, "", [], {},
     None, True, "x" * 3000, ["s"] * 40, {"\ud800": 1}]
)  # fmt: skip


SUPPORTED = {
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "stop",
    "seed",
    "user",
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "top_logprobs",
    "echo",
}


@st.composite
def bodies(draw: st.DrawFn, request_schema: str) -> dict[str, Any]:
    """A body of the schema with the served model most of the time, the output bounded to a few tokens (the
    run must stay short on 2 CPU cores), and sometimes a field replaced by a hostile value."""
    body: dict[str, Any] = draw(_strategy({"$ref": f"#/components/schemas/{request_schema}"}))
    if draw(st.booleans()):  # half the bodies keep only what this server supports, so most of them run
        body = {k: v for k, v in body.items() if k in SUPPORTED}
    if draw(st.integers(0, 9)):
        body["model"] = MODEL
    if draw(st.integers(0, 3)) == 0:
        field = draw(st.sampled_from([*sorted(body), "extra"]))
        body[field] = draw(HOSTILE_VALUES)
    for field in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(field), int) and 4 < body[field] < 100_000:
            body[field] = draw(st.integers(1, 4))
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = draw(st.integers(1, 4))  # else completions take 16 tokens, chat the context
    if isinstance(body.get("n"), int) and 2 < body["n"] <= 16:
        body["n"] = 2
    body.pop("stream", None)  # a stream answers 200 before it runs; errors then travel as events
    return body


def check_no_5xx(base: str, path: str, body: dict[str, Any], response_schema: str) -> None:
    """POST the body (hostile depth spliced in) with the fuzzing key: below 500, and a body of its schema."""
    raw = json.dumps(body).replace(json.dumps(_DEEP), nested(5000).decode()).encode()
    r = post(base, path, raw, key=KEYS[2])
    event(f"HTTP {r.status_code}")
    assert r.status_code < 500, (body, r.text[:500])
    schema.validate(r.json(), response_schema if r.status_code == 200 else "ErrorResponse")


PROPERTY = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


@PROPERTY
@given(body=bodies("CreateCompletionRequest"))
def test_no_completions_body_gets_a_5xx(
    live: tuple[cluster_fixture.LiveCluster, str], body: dict[str, Any]
) -> None:
    check_no_5xx(live[0].base, "/v1/completions", body, "CreateCompletionResponse")


@PROPERTY
@given(body=bodies("CreateChatCompletionRequest"))
def test_no_chat_body_gets_a_5xx(live: tuple[cluster_fixture.LiveCluster, str], body: dict[str, Any]) -> None:
    check_no_5xx(live[0].base, "/v1/chat/completions", body, "CreateChatCompletionResponse")


@settings(PROPERTY, max_examples=40)
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    data=st.data(),
    include_usage=st.booleans(),
)
def test_no_streamed_body_gets_a_server_error(
    live: tuple[cluster_fixture.LiveCluster, str], path: str, data: st.DataObject, include_usage: bool
) -> None:
    """Streamed: refused with a 4xx before the stream starts, or a 200 stream of chunks ending in [DONE];
    never a 5xx, nor a server error sent as an event once the 200 is out."""
    request = "CreateCompletionRequest" if path == "/v1/completions" else "CreateChatCompletionRequest"
    body = data.draw(bodies(request)) | {"stream": True, "stream_options": {"include_usage": include_usage}}
    raw = json.dumps(body).replace(json.dumps(_DEEP), nested(5000).decode()).encode()
    headers = {"content-type": "application/json", "authorization": f"Bearer {KEYS[2]}"}
    with httpx2.stream("POST", live[0].base + path, content=raw, headers=headers, timeout=120) as r:
        event(f"HTTP {r.status_code}")
        assert r.status_code < 500, (body, r.read()[:500])
        if r.status_code != 200:
            schema.validate(json.loads(r.read()), "ErrorResponse")
            return
        lines = [line for line in r.iter_lines() if line]
    assert lines and lines[-1] == "data: [DONE]", (body, lines[-3:])
    for line in lines[:-1]:
        chunk = json.loads(line.removeprefix("data: "))
        assert chunk.get("error", {}).get("type") != "server_error", (body, chunk)


def test_the_cluster_is_clean_after_the_property_run(live: tuple[cluster_fixture.LiveCluster, str]) -> None:
    live[0].wait_clean(timeout_s=30)


NODE_ROUTES = [
    ("GET", "/internal/info"),
    ("GET", "/internal/audit"),
    ("POST", "/internal/generate"),
    ("POST", "/internal/prefill"),
    ("POST", "/internal/abort"),
    ("POST", "/internal/drain"),
    ("POST", "/internal/undrain"),
    ("POST", "/internal/role"),
    ("POST", "/internal/evict"),
    ("POST", "/internal/hot-prefixes"),
    ("POST", "/internal/pull-prefix"),
    ("GET", "/internal/no-such-route"),
]


def test_node_routes_refuse_a_caller_without_the_cluster_credential(
    live: tuple[cluster_fixture.LiveCluster, str],
) -> None:
    """Every route answers 401 before its code runs (the body would be a valid evict of everything), to no
    header, a wrong token and the token without its scheme; health and metrics stay open."""
    cluster, _ = live
    url = next(iter(cluster.nodes.values())).url
    evict_all = json.dumps({"all": True}).encode()
    bearer = {"authorization": f"Bearer {cluster.auth_token}"}  # the token itself is no credential now
    raw = {"authorization": cluster.auth_token}
    for headers, auth in (({}, None), ({}, signed("not-the-token")), (raw, None), (bearer, None)):
        for method, path in NODE_ROUTES:
            r = httpx2.request(method, url + path, content=evict_all, headers=headers, auth=auth, timeout=10)
            assert r.status_code == 401, (method, path, headers, r.text)
            assert "cluster's KV-transfer token" in r.json()["error"]
    assert httpx2.get(f"{url}/internal/health", timeout=10).json()["draining"] is False  # no drain ran
    assert httpx2.get(f"{url}/metrics", timeout=10).status_code == 200
    info = httpx2.get(f"{url}/internal/info", auth=signed(cluster.auth_token), timeout=10)
    assert info.status_code == 200, info.text
    assert post(cluster.base, "/v1/completions", CMPL).status_code == 200  # the router holds the credential


BODY_ROUTES = ["/internal/generate", "/internal/prefill", "/internal/abort", "/internal/challenge",
               "/internal/drain", "/internal/role", "/internal/evict", "/internal/hot-prefixes",
               "/internal/pull-prefix"]  # fmt: skip


def test_node_routes_answer_a_malformed_body_with_a_400(
    live: tuple[cluster_fixture.LiveCluster, str],
) -> None:
    """A caller with the credential but a body that is not the route's message (not JSON, the wrong JSON)
    gets a 400 that names the problem, never a 500, and the node keeps serving."""
    cluster, _ = live
    url = next(iter(cluster.nodes.values())).url
    for body in (
        b"{not json",
        b"[1, 2]",
        json.dumps({"nonce": 7, "all": "yes", "block_hashes": "zz"}).encode(),
    ):
        for path in BODY_ROUTES:
            r = httpx2.post(url + path, content=body, auth=signed(cluster.auth_token), timeout=10)
            assert r.status_code == 400, (path, body, r.status_code, r.text)
            assert r.json()["error"], (path, body)
    assert httpx2.get(f"{url}/internal/health", timeout=10).json()["draining"] is False
    assert post(cluster.base, "/v1/completions", CMPL).status_code == 200


def test_kvctl_with_the_credential_still_evicts_drains_and_undrains(
    live: tuple[cluster_fixture.LiveCluster, str],
) -> None:
    cluster, _ = live
    node = next(iter(cluster.nodes))
    assert (
        cluster_fixture.kvctl(cluster.redis_url, "evict", "--node", node, "--all")["node_reply"]["ok"] is True
    )
    assert cluster_fixture.kvctl(cluster.redis_url, "drain", node)["node_reply"]["draining"] is True
    assert (
        cluster_fixture.kvctl(cluster.redis_url, "undrain", node, "--url", cluster.nodes[node].url)[
            "draining"
        ]
        is False
    )
    deadline = time.monotonic() + 30
    while (r := post(cluster.base, "/v1/completions", CMPL)).status_code != 200:
        assert time.monotonic() < deadline, r.text  # the router sees the node again within its node-list TTL
        time.sleep(0.2)
    cluster.wait_clean(timeout_s=30)
