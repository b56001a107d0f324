"""The router's request ids and error lines, one ASGI wrapper around the whole app.

Every HTTP request gets an id: the client's `X-Request-Id` when it sends a usable one, else a new one. It is
returned in the `X-Request-Id` header and bound to `REQUEST_ID` while the request runs, so a line logged
anywhere during it (a stream that ends in an error, say) can name it. Every 5xx answer is logged as one line
with the id, the route and the cause (the OpenAI error body's code and message); a client that left before
its answer (499) is one line too; an exception that escapes the app is logged as one such line, and uvicorn
then logs its traceback. The access log (uvicorn's) has
one line per request besides.

Invariants: it wraps the app from outside, so it sees the 500 that Starlette's last-resort handler sends; it
keeps a response's body only when the status is 5xx, and at most `_BODY_LIMIT` bytes of it; /health's 503
(the readiness report, asked every few seconds while no node pair can serve) is in the access log only.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from contextvars import ContextVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

REQUEST_ID: ContextVar[str] = ContextVar("request_id", default="-")
"""The id of the HTTP request being served (`-` outside one)."""

_ID_RE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_BODY_LIMIT = 64 * 1024
_QUIET_PATHS = frozenset({"/health"})


def _cause(body: bytes) -> str:
    """What a 5xx body says went wrong: `code: message` of an OpenAI error, else the start of the body."""
    try:
        error = json.loads(body)["error"]
        return f"{error.get('code') or error.get('type')}: {error['message']}"
    except (ValueError, KeyError, TypeError):
        return body[:300].decode(errors="replace") or "no body"


class RequestLog:
    """`uvicorn.run(RequestLog(app), ...)`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), b"").decode("latin-1")
        request_id = given if _ID_RE.fullmatch(given) else f"req-{uuid.uuid4().hex}"
        route = f"{scope['method']} {scope['path']}"
        status = 0
        body = bytearray()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {
                    **message,
                    "headers": [*message.get("headers", ()), (b"x-request-id", request_id.encode())],
                }
            elif message["type"] == "http.response.body" and status >= 500 and len(body) < _BODY_LIMIT:
                body.extend(message.get("body", b"")[: _BODY_LIMIT - len(body)])
            await send(message)

        token = REQUEST_ID.set(request_id)
        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            log.error("request %s %s: internal error, answered %s: %r", request_id, route, status or 500, exc)
            raise
        finally:
            REQUEST_ID.reset(token)
        if status == 499:
            log.info("request %s %s: the client left before its answer (499)", request_id, route)
        elif status >= 500 and scope["path"] not in _QUIET_PATHS:
            log.warning("request %s %s answered %d: %s", request_id, route, status, _cause(bytes(body)))
