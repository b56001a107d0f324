"""HTTP clients of the nodes' internal API (shared/node/node_protocol.py), one connection pool per node.

Invariants: one NodeClient per (node id, http url); a node that re-registers at a new URL gets a new
client and the old pool is closed. Every call is signed with a key derived from the cluster's credential
(shared/node/node_sign.py; the token itself never travels) and is bounded by the request's deadline
(absolute unix seconds). Every failure (unreachable, non-2xx,
malformed message, stream cut before finish_reason) is raised as NodeError naming the node; callers never
see httpx2 exceptions. A transport failure (refused, reset, cut mid-stream; `NodeError.unreachable`) is also
reported to `on_down` at once, which opens the node's circuit breaker (router/breaker.py). A read timeout is
the request's deadline, never the node's fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import secrets
import time
from collections.abc import AsyncIterator, Callable

import httpx2
from pdserve.shared.index.block_index_types import NodeInfo
from pdserve.shared.node.node_protocol import (
    CLIENT_KEEPALIVE_S,
    AbortRequest,
    ChallengeReply,
    ChallengeRequest,
    NodeGenerateRequest,
    PrefillRequest,
    PrefillResult,
    StepOutput,
)
from pdserve.shared.node.node_sign import ClusterKeys, SignedRequests
from pdserve.shared.types import NodeId, RequestId
from pdserve.shared.wire import JsonMessage

_JSON = {"content-type": "application/json"}
_ABORT_TIMEOUT_S = 5.0
_INFO_TIMEOUT_S = 10.0
_HEALTH_TIMEOUT_S = 1.0
_CHALLENGE_TIMEOUT_S = 2.0
_DRAIN_S = 0.5
_DOWN = (httpx2.NetworkError, httpx2.RemoteProtocolError)
"""Refused, reset or cut connections: the node (or the way to it) is gone."""

OnDown = Callable[[NodeId, str, str], None]
"""(node id, http url, reason): a call to the node failed at the transport level."""


async def _drain(lines: AsyncIterator[str]) -> None:
    """Reads a finished stream to its end (the node closes it right after its last step), so that httpx2
    keeps the connection for the next request: one closed unread makes the next request connect anew.
    A node that keeps it open past _DRAIN_S only costs that connection."""
    with contextlib.suppress(TimeoutError, httpx2.HTTPError):
        async with asyncio.timeout(_DRAIN_S):
            async for _ in lines:
                pass


class NodeError(Exception):
    """A node failed a call; `status` is its HTTP status when it replied, else None; `unreachable` when the
    connection was refused, reset or cut (the node may be dead: its breaker is open); `retryable` when the
    node failed the request before its first token for a reason another node may not have (a transfer cut)."""

    def __init__(
        self,
        node_id: NodeId,
        message: str,
        status: int | None = None,
        unreachable: bool = False,
        retryable: bool = False,
    ) -> None:
        super().__init__(f"node {node_id}: {message}")
        self.node_id = node_id
        self.status = status
        self.unreachable = unreachable
        self.retryable = retryable


class NodeClient:
    def __init__(
        self,
        node_id: NodeId,
        http_url: str,
        connect_timeout_s: float,
        max_connections: int,
        keys: ClusterKeys,
        on_down: OnDown | None = None,
    ) -> None:
        self.node_id = node_id
        self.http_url = http_url
        self._keys = keys
        self._connect_timeout_s = connect_timeout_s
        self._on_down = on_down
        self._http = httpx2.AsyncClient(
            base_url=http_url,
            auth=SignedRequests(keys),
            limits=httpx2.Limits(
                max_connections=max_connections,
                max_keepalive_connections=max_connections,
                keepalive_expiry=CLIENT_KEEPALIVE_S,
            ),
            timeout=httpx2.Timeout(_INFO_TIMEOUT_S, connect=connect_timeout_s),
        )

    def _timeout(self, deadline: float) -> httpx2.Timeout:
        remaining = max(deadline - time.time(), 0.001)
        return httpx2.Timeout(remaining, connect=min(self._connect_timeout_s, remaining))

    def _within(self, seconds: float) -> httpx2.Timeout:
        """A call's fixed timeout (not the request's deadline); the connect within the client's own."""
        return httpx2.Timeout(seconds, connect=self._connect_timeout_s)

    async def _post(self, path: str, message: JsonMessage, timeout: httpx2.Timeout) -> httpx2.Response:
        return await self._http.post(path, content=message.to_json(), headers=_JSON, timeout=timeout)

    def _failed(self, what: str, exc: Exception, deadline: float | None = None) -> NodeError:
        """The NodeError of a failed call; a transport failure is reported to on_down first. A connect
        timeout counts as one only while the deadline (if any) had time left for the connect."""
        down = isinstance(exc, _DOWN) or (
            isinstance(exc, httpx2.ConnectTimeout) and (deadline is None or deadline - time.time() > 0.0)
        )
        if down and self._on_down is not None:
            self._on_down(self.node_id, self.http_url, f"{what}: {type(exc).__name__}")
        return NodeError(self.node_id, f"{what} failed: {exc!r}", unreachable=down)

    async def health(self) -> bool | None:
        """None unless the node answers /internal/health as itself within a second; else whether it is
        draining."""
        try:
            resp = await self._http.get("/internal/health", timeout=_HEALTH_TIMEOUT_S)
            body = resp.json()
            if resp.status_code == 200 and body.get("node_id") == self.node_id:
                return bool(body.get("draining"))
        except (httpx2.HTTPError, ValueError, AttributeError):
            pass
        return None

    async def prove(self, epoch: int) -> bool:
        """Whether whoever serves http_url answers a fresh challenge as this node at `epoch`, i.e. holds the
        cluster's credential (a copied record pointing elsewhere fails). Never raises."""
        nonce = secrets.token_hex(16)
        try:
            timeout = self._within(_CHALLENGE_TIMEOUT_S)
            resp = await self._post("/internal/challenge", ChallengeRequest(nonce), timeout)
            reply = ChallengeReply.from_json(resp.content) if resp.status_code == 200 else None
        except (httpx2.HTTPError, ValueError):
            return False
        expected = self._keys.challenge_answer(nonce, self.node_id, epoch)
        return (
            reply is not None
            and reply.node_id == self.node_id
            and reply.epoch == epoch
            and hmac.compare_digest(reply.answer.encode(), expected.encode())
        )

    async def generate(self, request: NodeGenerateRequest) -> AsyncIterator[StepOutput]:
        """The node's step outputs for `request`, ending with the one that carries finish_reason."""
        try:
            async with self._http.stream(
                "POST",
                "/internal/generate",
                content=request.to_json(),
                headers=_JSON,
                timeout=self._timeout(request.deadline),
            ) as resp:
                if resp.status_code != 200:
                    self._check(resp.status_code, (await resp.aread()).decode(errors="replace"))
                lines = resp.aiter_lines()
                async for line in lines:
                    if not line.strip():
                        continue
                    step = StepOutput.from_line(line)
                    yield step
                    if step.finish_reason is not None:
                        await _drain(lines)
                        return
        except (httpx2.HTTPError, ValueError) as exc:
            raise self._failed("/internal/generate", exc, request.deadline) from exc
        cut = httpx2.RemoteProtocolError(f"generate stream of {request.request_id} ended before it finished")
        raise self._failed("/internal/generate", cut, request.deadline)

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        try:
            resp = await self._post("/internal/prefill", request, self._timeout(request.deadline))
            if resp.status_code == 502:  # P's transfer to D failed: its PrefillResult says why
                with contextlib.suppress(ValueError):
                    return PrefillResult.from_json(resp.content)
            self._check(resp.status_code, resp.text)
            return PrefillResult.from_json(resp.content)
        except (httpx2.HTTPError, ValueError) as exc:
            raise self._failed("/internal/prefill", exc, request.deadline) from exc

    async def abort(self, request_id: RequestId) -> None:
        try:
            timeout = self._within(_ABORT_TIMEOUT_S)
            resp = await self._post("/internal/abort", AbortRequest(request_id), timeout)
            self._check(resp.status_code, resp.text)
        except httpx2.HTTPError as exc:
            raise self._failed(f"/internal/abort of {request_id}", exc) from exc

    def _check(self, status: int, body: str) -> None:
        if not 200 <= status < 300:
            raise NodeError(self.node_id, f"HTTP {status}: {body[:500]}", status)

    async def aclose(self) -> None:
        await self._http.aclose()


class NodeClients:
    """The router's clients, keyed by node id; a node seen at a new URL gets a fresh pool. `on_down` is
    told of every transport failure (router/breaker.py's trip)."""

    def __init__(
        self, connect_timeout_s: float, max_connections: int, keys: ClusterKeys, on_down: OnDown | None = None
    ) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._max_connections = max_connections
        self._keys = keys
        self.on_down = on_down
        self._clients: dict[NodeId, NodeClient] = {}
        self._retired: list[NodeClient] = []
        self._seed_http = httpx2.AsyncClient(
            auth=SignedRequests(keys),
            timeout=httpx2.Timeout(_HEALTH_TIMEOUT_S, connect=min(connect_timeout_s, _HEALTH_TIMEOUT_S)),
        )

    def get(self, node_id: NodeId, http_url: str) -> NodeClient:
        client = self._clients.get(node_id)
        if client is not None and client.http_url == http_url:
            return client
        if client is not None:
            # In-flight streams may still use the old pool; it is closed with the others at shutdown.
            self._retired.append(client)
        client = NodeClient(
            node_id, http_url, self._connect_timeout_s, self._max_connections, self._keys, self._down
        )
        self._clients[node_id] = client
        return client

    def _down(self, node_id: NodeId, http_url: str, reason: str) -> None:
        if self.on_down is not None:
            self.on_down(node_id, http_url, reason)

    async def probe(self, node_id: NodeId, http_url: str) -> bool:
        """Whether the node answers its health at http_url (router/breaker.py's probe)."""
        return await self.get(node_id, http_url).health() is not None

    async def registration(self, http_url: str) -> NodeInfo:
        """The registration (epoch included) of whichever node serves http_url (a seed URL)."""
        url = http_url.rstrip("/") + "/internal/registration"
        try:
            resp = await self._seed_http.get(url)
            status, body = resp.status_code, resp.text[:200]
            if status != 200:
                raise NodeError(NodeId("?"), f"{url}: HTTP {status}: {body}", status)
            return NodeInfo.from_json(resp.content)
        except (httpx2.HTTPError, ValueError, TypeError, KeyError) as exc:
            raise NodeError(NodeId("?"), f"{url} failed: {exc!r}", unreachable=True) from exc

    async def aclose(self) -> None:
        for client in [*self._clients.values(), *self._retired]:
            await client.aclose()
        await self._seed_http.aclose()
        self._clients.clear()
        self._retired.clear()
