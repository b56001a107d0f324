"""Anthropic Messages and stream events from the chat path's answers, and Anthropic's error shape
(router/anthropic_api.py translates the request and serves the routes).

Invariants: every error is {"type": "error", "error": {"type", "message"}} with the type its HTTP status
names; a stop sequence (asked of the chat path with include_stop_str_in_output) is cut from the text and
reported as `stop_sequence`, and streamed text holds back an end that may still grow into one until it does
not; a stream's content blocks are started and stopped once each, one open at a time, `message_start` first
and `message_stop` last (an `error` event ends a failed one).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from pdserve.router.chat_bridge import ChatResult, stream_error
from pdserve.router.openai_protocol import OpenAIError

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


class AnthropicError(Exception):
    """A refusal in Anthropic's error shape."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers

    @classmethod
    def of(cls, err: OpenAIError) -> AnthropicError:
        return cls(err.status, err.message, err.headers)

    def body(self) -> dict[str, Any]:
        kind = _ERROR_TYPES.get(self.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


class StopTail:
    """Cuts a matched stop sequence from the end of the text; fed deltas, it holds back any end that may
    still grow into one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self._buf = ""

    def feed(self, text: str) -> str:
        buf = self._buf + text
        keep = max(
            (n for s in self.stops for n in range(min(len(s), len(buf)), 0, -1) if buf.endswith(s[:n])),
            default=0,
        )
        self._buf = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def release(self) -> str:
        """The text held back, when something other than text follows it (so it ended no stop sequence)."""
        buf, self._buf = self._buf, ""
        return buf

    def finish(self) -> tuple[str, str | None]:
        """(the rest of the text, the stop sequence it ended with or None)."""
        buf, self._buf = self._buf, ""
        for s in self.stops:
            if buf.endswith(s):
                return buf[: len(buf) - len(s)], s
        return buf, None


def _usage(usage: dict[str, Any] | None) -> dict[str, int]:
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "input_tokens": usage.get("prompt_tokens", 0) - cached,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
        "output_tokens": usage.get("completion_tokens", 0),
    }


def _stop_reason(finish: str | None, matched: str | None, tool_use: bool) -> str:
    if tool_use:
        return "tool_use"
    if matched is not None:
        return "stop_sequence"
    return _STOP_REASONS.get(finish or "stop", "end_turn")


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function") or {}
    try:
        args = json.loads(fn.get("arguments") or "{}")
    except json.JSONDecodeError:
        args = {"_raw": fn.get("arguments")}
    return {"type": "tool_use", "id": call.get("id"), "name": fn.get("name"), "input": args}


def to_message(chat: dict[str, Any], stops: list[str]) -> dict[str, Any]:
    """A Message from a chat.completion body."""
    choice = chat["choices"][0]
    msg = choice.get("message") or {}
    tail = StopTail(stops)
    text, matched = tail.feed(msg.get("content") or ""), None
    rest, matched = tail.finish()
    text += rest
    content: list[dict[str, Any]] = []
    if msg.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    if text:
        content.append({"type": "text", "text": text})
    calls = [_tool_use(c) for c in msg.get("tool_calls") or ()]
    content += calls
    return {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": chat["model"],
        "content": content,
        "stop_reason": _stop_reason(choice.get("finish_reason"), matched, bool(calls)),
        "stop_sequence": matched,
        "usage": _usage(chat.get("usage")),
    }


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, separators=(',', ':'))}\n\n".encode()


class _Blocks:
    """The content blocks of one streamed Message: one open at a time, each started and stopped once."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None
        self.tool_use = False

    def to(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.open = kind
        out.append(_event("content_block_start", {"index": self.index, "content_block": block}))
        return [*out, _event("ping", {})] if self.index == 0 else out

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.index})]

    def delta(self, kind: str, block: dict[str, Any], delta: dict[str, Any]) -> list[bytes]:
        out = self.to(kind, block) if self.open != kind else []
        return [*out, _event("content_block_delta", {"index": self.index, "delta": delta})]


async def to_events(
    result: ChatResult, model: str, stops: list[str], prompt_tokens: Callable[[], Coroutine[Any, Any, int]]
) -> AsyncIterator[bytes]:
    """Anthropic's stream events from the chat path's chunks. `message_start` waits for the first chunk
    after the chat stream's opening one, and carries the prompt's length, counted (`prompt_tokens`) while the
    nodes prefill."""
    assert result.chunks is not None
    chunks = result.chunks
    start: dict[str, Any] = {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": _usage(None),
    }
    blocks, tail = _Blocks(), StopTail(stops)
    finish: str | None = None
    counting: asyncio.Task[int] | None = None
    try:
        async for chunk in chunks:
            if (err := stream_error(chunk)) is not None:
                yield _event("error", AnthropicError.of(err).body())
                return
            if counting is None:  # the opening chunk comes before the run starts: count while it runs
                counting = asyncio.create_task(prompt_tokens())
                continue
            if start:
                try:
                    start["usage"]["input_tokens"] = await counting
                except OpenAIError as exc:
                    yield _event("error", AnthropicError.of(exc).body())
                    return
                yield _event("message_start", {"message": start})
                start = {}
            if not chunk.get("choices"):
                rest, matched = tail.finish()
                out = blocks.delta("text", {"type": "text", "text": ""}, {"type": "text_delta", "text": rest})
                for item in (out if rest else []) + blocks.close():
                    yield item
                delta = {
                    "stop_reason": _stop_reason(finish, matched, blocks.tool_use),
                    "stop_sequence": matched,
                }
                yield _event("message_delta", {"delta": delta, "usage": _usage(chunk.get("usage"))})
                yield _event("message_stop", {})
                return
            choice = chunk["choices"][0]
            finish = choice.get("finish_reason") or finish
            for item in _chunk_events(blocks, tail, choice.get("delta") or {}):
                yield item
    finally:
        if counting is not None:
            counting.cancel()
        await chunks.aclose()


def _chunk_events(blocks: _Blocks, tail: StopTail, delta: dict[str, Any]) -> list[bytes]:
    out: list[bytes] = []
    held = tail.release() if delta.get("reasoning_content") or delta.get("tool_calls") else ""
    if held:
        out += blocks.delta("text", {"type": "text", "text": ""}, {"type": "text_delta", "text": held})
    if delta.get("reasoning_content"):
        out += blocks.delta(
            "thinking",
            {"type": "thinking", "thinking": "", "signature": ""},
            {"type": "thinking_delta", "thinking": delta["reasoning_content"]},
        )
    text = tail.feed(delta.get("content") or "")
    if text:
        out += blocks.delta("text", {"type": "text", "text": ""}, {"type": "text_delta", "text": text})
    for call in delta.get("tool_calls") or ():
        fn = call.get("function") or {}
        if call.get("id"):
            blocks.tool_use = True
            out += blocks.to(
                "tool_use", {"type": "tool_use", "id": call["id"], "name": fn.get("name"), "input": {}}
            )
        if fn.get("arguments"):
            out += blocks.delta("tool_use", {}, {"type": "input_json_delta", "partial_json": fn["arguments"]})
    return out
