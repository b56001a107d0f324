"""The bridge the other request APIs (Anthropic Messages, OpenAI Responses) take onto the chat completions
path: their body is read and bounded here, translated by their module into a chat completions body, and
served by the same code as /v1/chat/completions (so routing, limits, tools and reasoning hold for them as
they do for chat); the chat reply comes back as plain objects for their module to translate.

Invariants: a translated request goes through the chat path's own checks (API key, size, validation) and
nothing else; a chat stream is consumed to its end or closed (`aclose`), so the run it carries is always
ended (router/handler.py cancels it when its stream is closed early).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pdserve.router.handler import Incoming, Reply
from pdserve.router.json_body import parse_json_body
from pdserve.router.openai_protocol import OpenAIError
from pdserve.router.reasoning import ChunkSplitter, split_message

ChatPath = Callable[[Incoming], Awaitable[Reply]]
"""What /v1/chat/completions runs: an Incoming in, its Reply (JSON or SSE chunks) out."""


async def read_body(body: AsyncIterable[bytes], limit: int) -> Any:
    """The request body as JSON; OpenAIError 413 past `limit` bytes, 400 when it is not strict JSON."""
    raw = bytearray()
    async for chunk in body:
        raw += chunk
        if len(raw) > limit:
            raise OpenAIError(413, f"request body exceeds the limit of {limit} bytes (--max-request-bytes)")
    return parse_json_body(bytes(raw))


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


@dataclass(frozen=True)
class ChatResult:
    """The chat path's answer: `body` (a chat.completion, or an OpenAI error body when status >= 400), or
    `chunks` (the chat.completion.chunk objects of a stream; an object with "error" ends a failed one)."""

    status: int
    body: dict[str, Any] | None = None
    chunks: AsyncGenerator[dict[str, Any], None] | None = None
    headers: dict[str, str] | None = None


async def run_chat(chat: ChatPath, body: dict[str, Any], like: Incoming) -> ChatResult:
    """Serves the chat completions `body` as the client of `like` (its key and disconnect probe)."""
    data = json.dumps(body, separators=(",", ":")).encode()
    reply = await chat(Incoming(like.authorization, _once(data), str(len(data)), like.is_disconnected))
    if reply.stream is None:
        return ChatResult(reply.status, reply.body, headers=reply.headers)
    return ChatResult(reply.status, chunks=_objects(reply.stream))


async def _objects(stream: AsyncIterator[bytes]) -> AsyncGenerator[dict[str, Any], None]:
    """The JSON objects of the chat path's SSE items (each item one `data: {...}` line), up to [DONE]."""
    try:
        async for item in stream:
            data = item.removeprefix(b"data: ").strip()
            if data == b"[DONE]":
                return
            yield json.loads(data)
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


def with_reasoning(reply: Reply, parser: str) -> Reply:
    """A chat reply with its reasoning split out by `parser` (router/reasoning.py): each message's
    `reasoning_content`, or each chunk's `delta.reasoning_content`. Errors pass as they are."""
    if reply.stream is not None:
        return Reply(reply.status, stream=_split_stream(reply.stream, ChunkSplitter(parser)))
    if reply.status != 200 or reply.body is None:
        return reply
    return Reply(reply.status, split_message(parser, reply.body), reply.headers)


async def _split_stream(stream: AsyncIterator[bytes], rewrite: ChunkSplitter) -> AsyncIterator[bytes]:
    try:
        async for item in stream:
            data = item.removeprefix(b"data: ").strip()
            if data == b"[DONE]" or b'"choices"' not in data:
                yield item
                continue
            out = json.dumps(rewrite.chunk(json.loads(data)), separators=(",", ":")).encode()
            yield b"data: " + out + b"\n\n"
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


def error_of(result: ChatResult) -> OpenAIError:
    """The OpenAI error a failed (status >= 400) chat result carries."""
    err = (result.body or {}).get("error") or {}
    return OpenAIError(
        result.status,
        str(err.get("message", "the request failed")),
        str(err.get("type", "invalid_request_error")),
        err.get("param"),
        err.get("code"),
        result.headers,
    )


_STATUS_OF_CODE = {"deadline_exceeded": 504, "client_disconnect": 499, "node_error": 500, "internal": 500}
_STATUS_OF_TYPE = {"invalid_request_error": 400, "rate_limit_exceeded": 429, "timeout_error": 504}


def stream_error(chunk: dict[str, Any]) -> OpenAIError | None:
    """The error a failed stream's last object carries, else None; its status is the one the chat path
    would have answered with before the stream began (router/errors.py), which the stream cannot carry."""
    err = chunk.get("error")
    if not isinstance(err, dict):
        return None
    code, kind = err.get("code"), str(err.get("type"))
    status = _STATUS_OF_CODE.get(str(code)) or _STATUS_OF_TYPE.get(kind, 503)
    return OpenAIError(status, str(err.get("message")), kind, err.get("param"), code)
