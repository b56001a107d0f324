"""A real HTTP server on a free loopback port, for tests where something stands in for a node (or a rogue
one): it serves from a daemon thread as soon as it is built, records every request it is sent, and answers
each with the test's function: JSON bytes (200), or None to cut the connection without a reply."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Seen:
    """One request as the fake server read it."""

    method: str
    path: str
    headers: Message[str, str]
    """Read by name, in any case, as HTTP headers are."""
    body: bytes


class FakeHTTP(ThreadingHTTPServer):
    def __init__(self, answer: Callable[[Seen], bytes | None]) -> None:
        self.answer = answer
        self.seen: list[Seen] = []
        super().__init__(("127.0.0.1", 0), _Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    def _any(self) -> None:
        server = self.server
        assert isinstance(server, FakeHTTP)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        seen = Seen(self.command, self.path, self.headers, body)
        server.seen.append(seen)
        reply = server.answer(seen)
        if reply is None:
            self.close_connection = True
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    do_GET = do_POST = _any

    def log_message(self, format: str, *args: Any) -> None:
        pass
