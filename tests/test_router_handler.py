"""router/handler.py's RequestHandler driven directly, without FastAPI or an HTTP server: request bodies in,
OpenAI replies out, over a real redis-server and the SmolLM2 tokenizer. The nodes registered here are
unreachable (a closed port) or serve another model, so every path ends in a refusal whose status and code
come from router/errors.py's one mapping."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from pdserve.cli.redis_launch import LocalRedis
from pdserve.router.config import RouterConfig
from pdserve.router.errors import _OPENAI, QueueFull, RouterError, to_openai
from pdserve.router.handler import Incoming, Reply, RequestHandler
from pdserve.shared.engine.block_hash import model_fingerprint
from pdserve.shared.index.block_index import BlockIndex
from pdserve.shared.index.block_index_types import NodeInfo, NodeLoad, RedisConfig
from pdserve.shared.model.gguf_loader import read_gguf
from pdserve.shared.model.loader import load_tokenizer
from pdserve.shared.model.tokenizer import Tokenizer
from pdserve.shared.node.node_protocol import ChallengeReply, ChallengeRequest
from pdserve.shared.node.node_sign import ClusterKeys
from pdserve.shared.types import KVLayout, NodeId
from pdserve.tests.harness.cluster_fixture import model_path
from pdserve.tests.harness.fake_http import FakeHTTP, Seen

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")

TOKEN = "handler-token"
KEYS = ClusterKeys(TOKEN)


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with LocalRedis() as server:
        yield server.url


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(model_path())


async def _body(data: bytes) -> AsyncIterator[bytes]:
    yield data


def _post(body: Any, authorization: str | None = None) -> Incoming:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return Incoming(authorization, _body(data), str(len(data)))


def _error(reply: Reply, status: int) -> dict[str, Any]:
    assert reply.status == status and reply.body is not None, reply
    error: dict[str, Any] = reply.body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


_EPOCHS: dict[str, int] = {}
"""The epoch each node registered under, as the prover answers for it."""


def _prove(seen: Seen) -> bytes | None:
    """Answers the router's challenge as the node registered at the URL, and cuts every other call (a node
    that proved itself, then died)."""
    node = seen.path.split("/")[1]
    if not seen.path.endswith("/internal/challenge"):
        return None
    nonce = ChallengeRequest.from_json(seen.body).nonce
    epoch = _EPOCHS[node]
    return ChallengeReply(NodeId(node), epoch, KEYS.challenge_answer(nonce, node, epoch)).to_json()


_PROVER: list[FakeHTTP] = []


async def _register(redis: RedisConfig, node: str, fingerprint: str) -> None:
    if not _PROVER:
        _PROVER.append(FakeHTTP(_prove))
    prover = _PROVER[0]
    async with BlockIndex(redis, KEYS) as index:
        for status in await index.nodes():
            await index.deregister(status.info.node_id)
        url = f"{prover.url}/{node}"
        info = NodeInfo(
            NodeId(node), "single", url, "127.0.0.1:1", fingerprint, LAYOUT, 1, 1000, "ab" * 32, 256
        )
        _EPOCHS[node] = await index.register(info, NodeLoad(0, 0, 0, 1000, 0))


async def _in_view(handler: RequestHandler, node: str) -> None:
    """Waits until the router's view holds `node` (listed, and its URL answered the challenge)."""
    for _ in range(600):
        if node in [s.info.node_id for s in await handler.membership.nodes()]:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{node} never entered the router's view")


def _run(redis_url: str, tokenizer: Tokenizer, cluster: str, scenario: Any, **kw: Any) -> None:
    redis = RedisConfig(url=redis_url, cluster=cluster, heartbeat_ttl_s=120)
    config = RouterConfig(model_path=model_path(), served_model_name="smol", redis=redis,
                          node_list_ttl_s=0.05, max_request_bytes=4096, node_token=TOKEN, **kw)  # fmt: skip

    async def go() -> None:
        handler = RequestHandler(config, tokenizer, BlockIndex(redis, KEYS))
        await handler.start()
        try:
            await scenario(handler, redis)
        finally:
            await handler.stop()

    asyncio.run(go())


def test_refusals_without_a_web_framework(redis_url: str, tokenizer: Tokenizer) -> None:
    async def scenario(handler: RequestHandler, _: RedisConfig) -> None:
        chat = {"model": "smol", "messages": [{"role": "user", "content": "hi"}]}
        assert _error(await handler.generate("chat", _post(b"{not json")), 400)["code"] is None
        too_big = _post({"model": "smol", "prompt": "x" * 5000})
        assert _error(await handler.generate("completions", too_big), 413)
        other = _error(await handler.generate("chat", _post({**chat, "model": "gpt-4"})), 404)
        assert other["code"] == "model_not_found" and other["param"] == "model"
        no_nodes = _error(await handler.generate("chat", _post(chat)), 503)
        assert no_nodes["code"] == "no_nodes" and no_nodes["type"] == "server_error"
        health = await handler.health()
        assert health.status == 503 and health.body is not None and health.body["status"] == "unavailable"
        assert b'pdserve_router_requests_in_flight{model_name="smol"} 0.0' in handler.metrics_page(None)

    _run(redis_url, tokenizer, "h-refusals", scenario)


def test_node_outcomes_reach_the_client_through_the_one_mapping(redis_url: str, tokenizer: Tokenizer) -> None:
    config, _, identity = read_gguf(model_path())
    ours = model_fingerprint(config.to_dict(), identity, "float32", 16).hex()
    prompt = {"model": "smol", "prompt": "The capital of France is", "max_tokens": 4}

    async def scenario(handler: RequestHandler, redis: RedisConfig) -> None:
        await _register(redis, "s-other", "cd" * 32)
        await _in_view(handler, "s-other")
        mismatch = _error(await handler.generate("completions", _post(prompt)), 503)
        assert mismatch["code"] == "model_mismatch" and "s-other" in mismatch["message"]
        await _register(redis, "s-gone", ours)
        await _in_view(handler, "s-gone")
        too_long = _error(await handler.generate("completions", _post({**prompt, "max_tokens": 300})), 400)
        assert too_long["code"] == "context_length_exceeded" and "256 tokens" in too_long["message"]
        gone = _error(await handler.generate("completions", _post(prompt)), 503)
        assert gone["code"] in ("node_unavailable", "no_nodes"), gone
        assert b'pdserve_router_requests_in_flight{model_name="smol"} 0.0' in handler.metrics_page(None)

    _run(redis_url, tokenizer, "h-nodes", scenario)


def test_api_keys_are_checked_before_the_body(redis_url: str, tokenizer: Tokenizer) -> None:
    async def scenario(handler: RequestHandler, _: RedisConfig) -> None:
        body = {"model": "smol", "prompt": "hi"}
        assert _error(await handler.generate("completions", _post(body)), 401)
        assert _error(await handler.generate("completions", _post(b"{", "Bearer k1")), 400)
        assert (await handler.models("Bearer k1"))["data"][0]["id"] == "smol"

    _run(redis_url, tokenizer, "h-keys", scenario, api_keys=("k1",))


@pytest.mark.parametrize("error", list(_OPENAI))
def test_every_domain_error_has_one_openai_form(error: type[RouterError]) -> None:
    status, type_, code = _OPENAI[error]
    mapped = to_openai(error("why"))
    assert (mapped.status, mapped.type, mapped.code, mapped.message) == (status, type_, code, "why")
    assert 400 <= status < 600 and mapped.headers is None
    assert to_openai(QueueFull("full", 3)).headers == {"Retry-After": "3"}
