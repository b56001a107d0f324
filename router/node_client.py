"""HTTP clients of the nodes' internal API (shared/node_protocol.py), one connection pool per node.

Invariants: one NodeClient per (node id, http url); a node that re-registers at a new URL gets a new
client and the old pool is closed. Every call carries the cluster's credential (when the router has one)
and is bounded by the request's deadline (absolute unix seconds). Every failure (unreachable, non-2xx,
malformed message, stream cut before finish_reason) is raised as NodeError naming the node; callers never
see httpx exceptions.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import httpx
from pdserve.shared.node_auth import bearer
from pdserve.shared.node_protocol import (
    CLIENT_KEEPALIVE_S,
    AbortRequest,
    NodeGenerateRequest,
    NodeInfoReply,
    PrefillRequest,
    PrefillResult,
    StepOutput,
)
from pdserve.shared.types import NodeId, RequestId

_JSON = {"content-type": "application/json"}
_ABORT_TIMEOUT_S = 5.0
_INFO_TIMEOUT_S = 10.0


class NodeError(Exception):
    """A node failed a call; `status` is its HTTP status when it replied, else None."""

    def __init__(self, node_id: NodeId, message: str, status: int | None = None) -> None:
        super().__init__(f"node {node_id}: {message}")
        self.node_id = node_id
        self.status = status


class NodeClient:
    def __init__(
        self,
        node_id: NodeId,
        http_url: str,
        connect_timeout_s: float,
        max_connections: int,
        token: str | None,
    ) -> None:
        self.node_id = node_id
        self.http_url = http_url
        self._connect_timeout_s = connect_timeout_s
        self._http = httpx.AsyncClient(
            base_url=http_url,
            headers=None if token is None else bearer(token),
            limits=httpx.Limits(
                max_connections=max_connections,
                max_keepalive_connections=max_connections,
                keepalive_expiry=CLIENT_KEEPALIVE_S,
            ),
            timeout=httpx.Timeout(_INFO_TIMEOUT_S, connect=connect_timeout_s),
        )

    def _timeout(self, deadline: float) -> httpx.Timeout:
        remaining = max(deadline - time.time(), 0.001)
        return httpx.Timeout(remaining, connect=min(self._connect_timeout_s, remaining))

    async def info(self) -> NodeInfoReply:
        try:
            resp = await self._http.get("/internal/info")
            self._check(resp.status_code, resp.text)
            return NodeInfoReply.from_json(resp.content)
        except (httpx.HTTPError, ValueError) as exc:
            raise NodeError(self.node_id, f"/internal/info failed: {exc!r}") from exc

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
                async for line in resp.aiter_lines():
                    if not line.strip():
                        continue
                    step = StepOutput.from_line(line)
                    yield step
                    if step.finish_reason is not None:
                        return
        except (httpx.HTTPError, ValueError) as exc:
            raise NodeError(self.node_id, f"/internal/generate failed: {exc!r}") from exc
        raise NodeError(self.node_id, f"generate stream of {request.request_id} ended before it finished")

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        try:
            resp = await self._http.post(
                "/internal/prefill",
                content=request.to_json(),
                headers=_JSON,
                timeout=self._timeout(request.deadline),
            )
            self._check(resp.status_code, resp.text)
            return PrefillResult.from_json(resp.content)
        except (httpx.HTTPError, ValueError) as exc:
            raise NodeError(self.node_id, f"/internal/prefill failed: {exc!r}") from exc

    async def abort(self, request_id: RequestId) -> None:
        try:
            resp = await self._http.post(
                "/internal/abort",
                content=AbortRequest(request_id).to_json(),
                headers=_JSON,
                timeout=httpx.Timeout(_ABORT_TIMEOUT_S, connect=self._connect_timeout_s),
            )
            self._check(resp.status_code, resp.text)
        except httpx.HTTPError as exc:
            raise NodeError(self.node_id, f"/internal/abort of {request_id} failed: {exc!r}") from exc

    def _check(self, status: int, body: str) -> None:
        if not 200 <= status < 300:
            raise NodeError(self.node_id, f"HTTP {status}: {body[:500]}", status)

    async def aclose(self) -> None:
        await self._http.aclose()


class NodeClients:
    """The router's clients, keyed by node id; a node seen at a new URL gets a fresh pool."""

    def __init__(self, connect_timeout_s: float, max_connections: int, token: str | None) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._max_connections = max_connections
        self._token = token
        self._clients: dict[NodeId, NodeClient] = {}
        self._retired: list[NodeClient] = []

    def get(self, node_id: NodeId, http_url: str) -> NodeClient:
        client = self._clients.get(node_id)
        if client is not None and client.http_url == http_url:
            return client
        if client is not None:
            # In-flight streams may still use the old pool; it is closed with the others at shutdown.
            self._retired.append(client)
        client = NodeClient(node_id, http_url, self._connect_timeout_s, self._max_connections, self._token)
        self._clients[node_id] = client
        return client

    async def aclose(self) -> None:
        for client in [*self._clients.values(), *self._retired]:
            await client.aclose()
        self._clients.clear()
        self._retired.clear()
