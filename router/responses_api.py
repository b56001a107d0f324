"""OpenAI's Responses API on the router: `POST /v1/responses`, streamed or not, as a translation onto the chat
completions path (router/chat_bridge.py).

Input (a string, or message, function_call and function_call_output items) and `instructions` become chat
messages; function tools, `tool_choice`, `text.format` (json_schema / json_object, as response_format),
`max_output_tokens`, temperature and top_p carry over. The chat answer becomes a Response whose output holds
a reasoning item (when the router's reasoning parser found a thought), a message item with its output_text,
and a function_call item per tool call; streamed, the same as Responses events.

Invariants: the server is stateless (`store` is always false in what it returns): `previous_response_id`,
`conversation` and background mode are refused with 400 and a retrieved id is 404, so no client waits on
state that is not kept; every error is OpenAI's ErrorResponse (in a stream, an `error` event); every event
carries its sequence_number, counted from 0 for each stream.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pdserve.router.chat_bridge import ChatPath, ChatResult, error_of, read_body, run_chat, stream_error
from pdserve.router.handler import Incoming, Reply, error_reply
from pdserve.router.openai_protocol import OpenAIError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

_STATELESS = "this server stores no responses; send the whole conversation as `input` items (store: false)"


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Model):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(_Model):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]


class FunctionCallItem(_Model):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Model):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]


class ReasoningItem(_Model):
    """A thought of an earlier turn: the client keeps it; the model does not see it again."""

    type: Literal["reasoning"]


_ITEMS: dict[str, type[_Model]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


class FunctionTool(_Model):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Model):
    type: Literal["function"]
    name: str


class TextFormat(_Model):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Model):
    format: TextFormat | None = None


class ResponsesRequest(_Model):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None


def _bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param=param)


def parse_request(body: Any) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise OpenAIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        req = ResponsesRequest.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise OpenAIError(
            400, f"{param}: {err['msg']} (got {repr(err.get('input'))[:80]})", param=param
        ) from exc
    for name, value in (
        ("previous_response_id", req.previous_response_id),
        ("conversation", req.conversation),
    ):
        if value is not None:
            raise _bad(name, f"not supported: {_STATELESS}")
    if req.background:
        raise _bad("background", f"background responses are not supported: {_STATELESS}")
    if req.reasoning:
        raise _bad(
            "reasoning",
            "reasoning options are not supported; a thinking model's thought comes back as a "
            "reasoning item when the router runs with --reasoning-parser",
        )
    return req


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for i, raw in enumerate(items):
        kind = raw.get("type", "message") if isinstance(raw, dict) else None
        model = _ITEMS.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise _bad(f"input[{i}]", f"item type {kind!r} is not supported; accepted: {sorted(_ITEMS)}")
        try:
            item = model.model_validate(raw)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in (f"input[{i}]", *err["loc"]))
            raise _bad(f"input[{i}]", f"{where}: {err['msg']}") from exc
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and i > 0:
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    return out


def to_chat(req: ResponsesRequest) -> dict[str, Any]:
    """The chat completions body of a Responses request."""
    body: dict[str, Any] = {"model": req.model, "messages": _messages(req)}
    optional = {
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "parallel_tool_calls": req.parallel_tool_calls,
        "user": req.user,
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in req.tools
        ]
    if isinstance(req.tool_choice, NamedFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None or not fmt.name:
            raise _bad("text.format", "a json_schema format needs its `name` and `schema`")
        schema = {
            "name": fmt.name,
            "schema": fmt.schema_,
            **({"strict": fmt.strict} if fmt.strict is not None else {}),
        }
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


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


class _Head:
    """What every Response object of one request shares."""

    def __init__(self, req: ResponsesRequest) -> None:
        self.req = req
        self.id = _id("resp")
        self.created_at = int(time.time())

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        incomplete: bool = False,
    ) -> dict[str, Any]:
        req = self.req
        fmt = (
            req.text.format.model_dump(by_alias=True, exclude_none=True)
            if req.text and req.text.format
            else None
        )
        choice: Any = (
            req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunction) else req.tool_choice
        )
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": req.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tool_choice": choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "text": {"format": fmt or {"type": "text"}},
            "truncation": req.truncation or "disabled",
            "usage": None if usage is None else _usage(usage),
            "metadata": req.metadata or {},
            "user": req.user,
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


def to_response(head: _Head, chat: dict[str, Any]) -> dict[str, Any]:
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


async def to_events(head: _Head, result: ChatResult) -> AsyncIterator[bytes]:
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


class ResponsesAPI:
    def __init__(self, chat: ChatPath, max_body_bytes: int) -> None:
        self.chat = chat
        self.max_body_bytes = max_body_bytes

    async def create(self, incoming: Incoming) -> Reply:
        try:
            req = parse_request(await read_body(incoming.body, self.max_body_bytes))
            head = _Head(req)
            result = await run_chat(self.chat, to_chat(req), incoming)
            if result.status >= 400:
                raise error_of(result)
            if result.chunks is not None:
                return Reply(200, stream=to_events(head, result))
            assert result.body is not None
            return Reply(200, to_response(head, result.body))
        except OpenAIError as exc:
            return error_reply(exc)

    @staticmethod
    def not_stored(response_id: str) -> OpenAIError:
        return OpenAIError(
            404,
            f"response {response_id!r} was not found: {_STATELESS}",
            param="response_id",
            code="not_found",
        )
