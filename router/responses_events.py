"""OpenAI Responses objects and stream events from the chat path's answers: a chat.completion becomes a
Response; chat.completion.chunk objects become response.* events (router/responses_api.py translates the
request and serves the route).

Invariants: the output items come in the order the chat answer produced them (reasoning, message, function
calls), each opened (`output_item.added`) and closed (`output_item.done`) once, one at a time; every event
carries its sequence_number, counted from 0 for each stream; a failure after the start is an `error` event.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pdserve.router.chat_bridge import ChatResult, stream_error


def _usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseHead:
    """What every Response object of one request shares: its id, creation time and the request's fields
    that a Response repeats (`echo`, from router/responses_api.py's `echoed`)."""

    def __init__(self, echo: dict[str, Any]) -> None:
        self.echo = echo
        self.id = _id("resp")
        self.created_at = int(time.time())

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        incomplete: bool = False,
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": output,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "usage": None if usage is None else _usage(usage),
            **self.echo,
        }


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "status": status,
        "content": [{"type": "reasoning_text", "text": text}],
    }


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def to_response(head: ResponseHead, chat: dict[str, Any]) -> dict[str, Any]:
    """A Response from a chat.completion body."""
    choice = chat["choices"][0]
    msg = choice.get("message") or {}
    output: list[dict[str, Any]] = []
    if msg.get("reasoning_content"):
        output.append(_reasoning_item(_id("rs"), msg["reasoning_content"], "completed"))
    calls = msg.get("tool_calls") or []
    if msg.get("content") or not calls:
        output.append(_message_item(_id("msg"), msg.get("content") or "", "completed"))
    for c in calls:
        fn = c.get("function") or {}
        output.append(
            _call_item(_id("fc"), c.get("id", ""), fn.get("name", ""), fn.get("arguments", ""), "completed")
        )
    incomplete = choice.get("finish_reason") == "length"
    return head.response("incomplete" if incomplete else "completed", output, chat.get("usage"), incomplete)


class _Events:
    """The events of one streamed Response: its output items opened and closed in order, one at a time."""

    def __init__(self) -> None:
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.kind: str | None = None
        self.item: dict[str, Any] = {}
        self.text = ""

    def event(self, kind: str, **data: Any) -> bytes:
        obj = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item["id"], "output_index": len(self.output)}

    def open(self, kind: str, item: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.kind, self.item, self.text = kind, item, ""
        out.append(self.event("response.output_item.added", output_index=len(self.output), item=item))
        if kind == "message":
            out.append(
                self.event("response.content_part.added", **self._where(), content_index=0, part=_part(""))
            )
        return out

    def delta(self, kind: str, text: str, item: dict[str, Any] | None = None) -> list[bytes]:
        out = self.open(kind, item or {}) if self.kind != kind or item is not None else []
        self.text += text
        where = self._where()
        if kind == "message":
            out.append(
                self.event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=[])
            )
        elif kind == "reasoning":
            out.append(self.event("response.reasoning_text.delta", **where, content_index=0, delta=text))
        else:
            out.append(self.event("response.function_call_arguments.delta", **where, delta=text))
        return out

    def close(self) -> list[bytes]:
        kind, item, text, where = self.kind, self.item, self.text, self._where() if self.kind else {}
        if kind is None:
            return []
        out = []
        if kind == "message":
            out.append(
                self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[])
            )
            out.append(self.event("response.content_part.done", **where, content_index=0, part=_part(text)))
            item = _message_item(item["id"], text, "completed")
        elif kind == "reasoning":
            out.append(self.event("response.reasoning_text.done", **where, content_index=0, text=text))
            item = _reasoning_item(item["id"], text, "completed")
        else:
            out.append(self.event("response.function_call_arguments.done", **where, arguments=text))
            item = {**item, "arguments": text, "status": "completed"}
        out.append(self.event("response.output_item.done", output_index=len(self.output), item=item))
        self.output.append(item)
        self.kind = None
        return out


async def to_events(head: ResponseHead, result: ChatResult) -> AsyncIterator[bytes]:
    """The Responses stream events from the chat path's chunks."""
    assert result.chunks is not None
    chunks, ev = result.chunks, _Events()
    yield ev.event("response.created", response=head.response("in_progress", []))
    yield ev.event("response.in_progress", response=head.response("in_progress", []))
    finish: str | None = None
    try:
        async for chunk in chunks:
            if (err := stream_error(chunk)) is not None:
                yield ev.event("error", code=err.code, message=err.message, param=err.param)
                return
            if not chunk.get("choices"):
                for item in ev.close():
                    yield item
                incomplete = finish == "length"
                status = "incomplete" if incomplete else "completed"
                yield ev.event(
                    f"response.{status}",
                    response=head.response(status, ev.output, chunk.get("usage"), incomplete),
                )
                return
            choice = chunk["choices"][0]
            finish = choice.get("finish_reason") or finish
            for item in _chunk_events(ev, choice.get("delta") or {}):
                yield item
    finally:
        await chunks.aclose()


def _chunk_events(ev: _Events, delta: dict[str, Any]) -> list[bytes]:
    out: list[bytes] = []
    if delta.get("reasoning_content"):
        new = _reasoning_item(_id("rs"), "", "in_progress") if ev.kind != "reasoning" else None
        out += ev.delta("reasoning", delta["reasoning_content"], new)
    if delta.get("content"):
        new = _message_item(_id("msg"), None, "in_progress") if ev.kind != "message" else None
        out += ev.delta("message", delta["content"], new)
    for call in delta.get("tool_calls") or ():
        fn = call.get("function") or {}
        if call.get("id"):
            out += ev.open(
                "function_call", _call_item(_id("fc"), call["id"], fn.get("name", ""), "", "in_progress")
            )
        if fn.get("arguments"):
            out += ev.delta("function_call", fn["arguments"])
    return out
