"""The router's connection guard: deadlines for a request's headers and body, and a cap on the connections
one client address holds open, which uvicorn does not offer (its protocols time out only a keep-alive
connection that sends nothing after a response; a client sending its headers or body one byte at a time,
or nothing at all after connecting, keeps its socket forever).

One FrontGuard serves one server. `protocol()` is the HTTP protocol class uvicorn runs (`http=`): it counts
each connection under its client's address, refuses one over the cap with a 429, and arms the header
deadline when a connection opens and after each response. `wrap(app)` is the ASGI app uvicorn calls once a
request's headers are in: it swaps the header deadline for the body deadline, which ends when the app has
received the whole body or started its answer. A deadline that passes closes the connection (the app sees
`http.disconnect`, as when the client leaves).

Invariants: an open connection that was not refused is in `_conns` under its (host, port) once and counted
once in `_per_host[host]`; `connection_lost` removes both and cancels its deadline; a connection has at most
one deadline armed, and a request's body phase disarms only its own deadline (`_Conn.phase`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from dataclasses import dataclass

from pdserve.router.openai_protocol import OpenAIError
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

Client = tuple[str, int]


@dataclass
class _Conn:
    transport: asyncio.BaseTransport
    deadline: asyncio.TimerHandle | None = None
    phase: int = 0
    """Bumped each time a deadline is armed, so that a finished phase cannot disarm a later one."""


def _too_many(limit: int) -> bytes:
    err = OpenAIError(429, f"this client address already holds {limit} connections to the router (the "
                      "router's --max-connections-per-client); reuse connections or close idle ones",
                      "rate_limit_exceeded", code="too_many_connections")  # fmt: skip
    body = json.dumps(err.body()).encode()
    head = (
        "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
        f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class FrontGuard:
    """Header and body deadlines (seconds) and connections per client address (0: no cap) of one server."""

    def __init__(self, header_timeout_s: float, body_timeout_s: float, max_per_client: int) -> None:
        if header_timeout_s <= 0 or body_timeout_s <= 0 or max_per_client < 0:
            raise ValueError("the header and body timeouts must be > 0 and the connection cap >= 0")
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.max_per_client = max_per_client
        self._conns: dict[Client, _Conn] = {}
        self._per_host: Counter[str] = Counter()
        self._capped: set[str] = set()
        """Hosts refused since they last dropped below the cap (one log line per episode)."""

    def protocol(self) -> type[H11Protocol]:
        """uvicorn's h11 protocol, guarded (pass as `uvicorn.run(..., http=guard.protocol())`)."""
        guard = self

        class GuardedH11Protocol(H11Protocol):
            def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
                super().connection_made(transport)
                guard._opened(self.client, transport)

            def connection_lost(self, exc: Exception | None) -> None:
                guard._closed(self.client)
                super().connection_lost(exc)

            def on_response_complete(self) -> None:
                super().on_response_complete()
                guard._await_headers(self.client)

        return GuardedH11Protocol

    def wrap(self, app: ASGIApp) -> ASGIApp:
        """The ASGI app that runs the body deadline around `app`."""

        async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
            client = scope.get("client") if scope["type"] == "http" else None
            conn = self._conns.get((client[0], client[1])) if client else None
            if conn is None:
                await app(scope, receive, send)
                return
            phase = self._arm(conn, self.body_timeout_s, "body")

            async def receive_guarded() -> Message:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    self._disarm(conn, phase)
                return message

            async def send_guarded(message: Message) -> None:
                if message["type"] == "http.response.start":
                    self._disarm(conn, phase)
                await send(message)

            await app(scope, receive_guarded, send_guarded)

        return guarded

    def _opened(self, client: Client | None, transport: asyncio.BaseTransport) -> None:
        if client is None:  # a Unix socket: no address to count
            return
        host = client[0]
        if self.max_per_client and self._per_host[host] >= self.max_per_client:
            if host not in self._capped:
                self._capped.add(host)
                log.warning("refusing connections from %s: it holds %d, the limit "
                            "(--max-connections-per-client)", host, self._per_host[host])  # fmt: skip
            assert isinstance(transport, asyncio.WriteTransport)
            transport.write(_too_many(self.max_per_client))
            transport.close()
            return
        self._per_host[host] += 1
        conn = self._conns[client] = _Conn(transport)
        self._arm(conn, self.header_timeout_s, "headers")

    def _closed(self, client: Client | None) -> None:
        conn = self._conns.pop(client, None) if client else None
        if conn is None or client is None:
            return
        self._disarm(conn, conn.phase)
        host = client[0]
        self._per_host[host] -= 1
        if self._per_host[host] <= 0:
            del self._per_host[host]
        if self._per_host[host] < self.max_per_client:
            self._capped.discard(host)

    def _await_headers(self, client: Client | None) -> None:
        conn = self._conns.get(client) if client else None
        if conn is not None and not conn.transport.is_closing():
            self._arm(conn, self.header_timeout_s, "headers")

    def _arm(self, conn: _Conn, seconds: float, what: str) -> int:
        self._disarm(conn, conn.phase)
        conn.phase += 1
        conn.deadline = asyncio.get_running_loop().call_later(seconds, self._expire, conn, what, seconds)
        return conn.phase

    @staticmethod
    def _disarm(conn: _Conn, phase: int) -> None:
        if conn.phase == phase and conn.deadline is not None:
            conn.deadline.cancel()
            conn.deadline = None

    @staticmethod
    def _expire(conn: _Conn, what: str, seconds: float) -> None:
        conn.deadline = None
        if not conn.transport.is_closing():
            peer = conn.transport.get_extra_info("peername")
            flag = "--header-timeout" if what == "headers" else "--body-timeout"
            log.info("closed the connection from %s: its request's %s did not arrive within %g s (%s)",
                     peer, what, seconds, flag)  # fmt: skip
            conn.transport.close()
