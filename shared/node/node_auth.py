"""The cluster's credential on a node's internal HTTP API: every route but OPEN_PATHS answers 401 unless the
request is signed with a key derived from the cluster token (shared/node/node_sign.py: a MAC over method,
path, timestamp, nonce and body digest, inside the clock window, its nonce never seen before).

Invariants: checked in one place, an ASGI middleware in front of every route, so a route added later is
closed by default; the header is parsed and its clock window checked before the body is read, the body is
read whole (at most MAX_BODY bytes) and replayed to the route only once the MAC matches; a refusal never
reaches a route's code (no engine call is made). Health and metrics stay open for probes and scrapers.
The token never leaves the process: nothing it could be replayed from goes on the wire, and a node
registers `credential_digest(token)`, which the index compares across nodes like the KV layout.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from pdserve.shared.node.node_sign import SCHEME, Claim, RequestVerifier
from starlette.types import ASGIApp, Message, Receive, Scope, Send

OPEN_PATHS = frozenset({"/internal/health", "/metrics"})
MAX_BODY = 64 << 20
"""Bytes of a request body read before its MAC is checked (a prefill request of a long prompt fits)."""

_DIGEST_KEY = b"pdserve cluster credential v1"


def credential_digest(token: str) -> str:
    """64 hex digits naming the credential in a node's registration: nodes of one cluster must show the same
    digest (a node with another token is refused at registration). Keyed by a fixed domain string so the
    digest is of no use anywhere else; it can be checked against a guessed token, so a token must be hard to
    guess (`pdserve up` draws 128 random bits)."""
    return hmac.new(_DIGEST_KEY, token.encode(), hashlib.sha256).hexdigest()


class NodeAuth:
    """`app.add_middleware(NodeAuth, verifier=RequestVerifier(keys, window_s))`."""

    def __init__(self, app: ASGIApp, verifier: RequestVerifier) -> None:
        self.app = app
        self._verifier = verifier

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        claim = self._verifier.claim(header)
        if not isinstance(claim, Claim):
            await _refuse(scope, send, claim)
            return
        body = await _read_body(receive)
        if body is None:
            await _refuse(scope, send, f"body over {MAX_BODY} bytes or cut", 413)
            return
        target = scope.get("raw_path") or scope["path"].encode()
        if scope["query_string"]:
            target += b"?" + scope["query_string"]
        refused = self._verifier.check(claim, scope["method"], target, body)
        if refused is not None:
            await _refuse(scope, send, refused)
            return
        await self.app(scope, _replay(body, receive), send)


async def _read_body(receive: Receive) -> bytes | None:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The route's receive: the body already read, then the client's own messages (a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _refuse(scope: Scope, send: Send, why: str, status: int = 401) -> None:
    body = json.dumps(
        {
            "error": f"{scope['path']}: {why}; internal calls are signed with the cluster's KV-transfer "
            "token (PDSERVE_AUTH_TOKEN), as the router, kvctl and the nodes do"
        }
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", SCHEME.encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
