"""The cluster's credential on a node's internal HTTP API: every route but OPEN_PATHS answers 401 unless the
request carries `Authorization: Bearer <token>`, the token being the KV-transfer token every node, the router
and kvctl already hold (PDSERVE_AUTH_TOKEN or the file PDSERVE_AUTH_TOKEN_FILE names).

Invariants: checked in one place, an ASGI middleware in front of every route, so a route added later is
closed by default; the header is compared in constant time; a refusal never reaches a route's code (no
body is read, no engine call is made). Health and metrics stay open for probes and scrapers. The token never
leaves the process: a node registers `credential_digest(token)` (HMAC-SHA256 keyed by a fixed domain
string), which the index compares across nodes like the KV layout.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

OPEN_PATHS = frozenset({"/internal/health", "/metrics"})


_DIGEST_KEY = b"pdserve cluster credential v1"


def credential_digest(token: str) -> str:
    """64 hex digits naming the credential in a node's registration: nodes of one cluster must show the same
    digest (a node with another token is refused at registration). Keyed by a fixed domain string so the
    digest is of no use anywhere else; it can be checked against a guessed token, so a token must be hard to
    guess (`pdserve up` draws 128 random bits)."""
    return hmac.new(_DIGEST_KEY, token.encode(), hashlib.sha256).hexdigest()


def bearer(token: str) -> dict[str, str]:
    """The header a client of the internal API sends."""
    return {"authorization": f"Bearer {token}"}


class NodeAuth:
    """`app.add_middleware(NodeAuth, token=...)`."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        if not token:
            raise ValueError("the node's internal API needs a non-empty token")
        self.app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self._expected):
                await _refuse(scope, send)
                return
        await self.app(scope, receive, send)


async def _refuse(scope: Scope, send: Send) -> None:
    body = json.dumps(
        {
            "error": f"{scope['path']}: missing or wrong cluster credential; send 'Authorization: Bearer "
            "<token>' with the cluster's KV-transfer token (PDSERVE_AUTH_TOKEN)"
        }
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", b"Bearer"),
    ]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body})
