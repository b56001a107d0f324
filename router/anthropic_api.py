"""Anthropic's Messages API on the router: `POST /v1/messages` (streamed or not) and
`POST /v1/messages/count_tokens`, as translations onto the chat completions path (router/chat_bridge.py).

A request is validated by the pydantic models below, becomes a chat completions body (system -> a system
message, `tool_use` blocks -> assistant tool_calls, `tool_result` blocks -> tool messages, `tools` ->
function tools, `tool_choice` any -> required, `stop_sequences` -> stop), and the chat answer becomes a
Message (text, thinking and tool_use blocks, stop_reason, usage) or Anthropic's stream events.

Invariants: every error leaves in Anthropic's shape ({"type": "error", "error": {"type", "message"}}) with
the status the chat path chose; the key is read from `x-api-key` or `Authorization: Bearer`; a stop
sequence is asked of the chat path with include_stop_str_in_output, so that the one that matched is known,
and it is cut from the text (streamed text holds back what may be the start of one until it is not).
"""

from __future__ import annotations

import asyncio
import functools
import json
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Annotated, Any, Literal

from pdserve.router.chat_bridge import ChatPath, ChatResult, error_of, read_body, run_chat, stream_error
from pdserve.router.handler import Incoming, Reply
from pdserve.router.openai_protocol import OpenAIError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

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


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Model):
    type: Literal["text"]
    text: str


class ThinkingBlock(_Model):
    """A thought of an earlier assistant turn: kept by the client, not shown to the model again."""

    type: Literal["thinking", "redacted_thinking"]


class ToolUseBlock(_Model):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Model):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False


Block = Annotated[TextBlock | ThinkingBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class MessageParam(_Model):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Model):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Model):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = None


class OutputFormat(_Model):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Model):
    format: OutputFormat | None = None
    effort: None = None
    """Refused when set: the model has one way of answering."""


class CountTokensRequest(_Model):
    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None
    stream: bool = False


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


def api_key(x_api_key: str | None, authorization: str | None) -> str | None:
    """The Authorization header the chat path checks: Anthropic clients send the key as `x-api-key`."""
    return f"Bearer {x_api_key}" if x_api_key else authorization


def _parse(model: type[CountTokensRequest], body: Any) -> Any:
    if not isinstance(body, dict):
        raise AnthropicError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        raise AnthropicError(400, f"{where}: {err['msg']} (got {repr(err.get('input'))[:80]})") from exc


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def _messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system)})
    for m in req.messages:
        blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        if m.role == "assistant":
            calls = [
                {
                    "id": b.id,
                    "type": "function",
                    "function": {"name": b.name, "arguments": json.dumps(b.input)},
                }
                for b in blocks
                if isinstance(b, ToolUseBlock)
            ]
            out.append({"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})})
            continue
        for b in blocks:
            if isinstance(b, ToolResultBlock):
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)})
        if text or not any(isinstance(b, ToolResultBlock) for b in blocks):
            out.append({"role": "user", "content": text})
    return out


def to_chat(req: CountTokensRequest, model: str | None = None) -> dict[str, Any]:
    """The chat completions body of a Messages (or count_tokens) request."""
    body: dict[str, Any] = {"model": model or req.model, "messages": _messages(req)}
    if req.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "parameters": t.input_schema,
                    **({"description": t.description} if t.description else {}),
                },
            }
            for t in req.tools
        ]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise AnthropicError(400, "tool_choice: type 'tool' needs the tool's `name`")
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {
            "type": "function",
            "function": {"name": choice.name},
        }
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    fmt = req.output_config.format if req.output_config else None
    if fmt is not None:
        schema = {"name": "output", "schema": fmt.schema_, "strict": True}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    if req.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type == "enabled"}
    if isinstance(req, MessagesRequest):
        body["max_tokens"] = req.max_tokens
        optional = {
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "user": (req.metadata or {}).get("user_id"),
        }
        body.update({k: v for k, v in optional.items() if v is not None})
        if req.stop_sequences:
            body["stop"] = req.stop_sequences
            body["include_stop_str_in_output"] = True
        if req.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
    return body


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


Counter = Callable[[str | None, dict[str, Any]], Coroutine[Any, Any, int]]
"""(Authorization header, chat completions body) -> the prompt's token count, as the chat path tokenizes
it (RequestHandler.count_prompt_tokens)."""


class AnthropicAPI:
    """The two routes, over the chat path and the handler's tokenizer."""

    def __init__(self, chat: ChatPath, count: Counter, max_body_bytes: int) -> None:
        self.chat = chat
        self.count = count
        self.max_body_bytes = max_body_bytes

    async def messages(self, incoming: Incoming) -> Reply:
        try:
            req = _parse(MessagesRequest, await self._body(incoming))
            result = await run_chat(self.chat, to_chat(req), incoming)
            if result.status >= 400:
                raise AnthropicError.of(error_of(result))
            stops = req.stop_sequences or []
            if result.chunks is not None:
                body = to_chat(req)
                count = functools.partial(self.count, incoming.authorization, body)
                return Reply(200, stream=to_events(result, req.model, stops, count))
            assert result.body is not None
            return Reply(200, to_message(result.body, stops))
        except AnthropicError as exc:
            return Reply(exc.status, exc.body(), exc.headers)

    async def count_tokens(self, incoming: Incoming) -> Reply:
        try:
            req = _parse(CountTokensRequest, await self._body(incoming))
            try:
                n = await self.count(incoming.authorization, to_chat(req))
            except OpenAIError as exc:
                raise AnthropicError.of(exc) from exc
            return Reply(200, {"input_tokens": n})
        except AnthropicError as exc:
            return Reply(exc.status, exc.body(), exc.headers)

    async def _body(self, incoming: Incoming) -> Any:
        try:
            return await read_body(incoming.body, self.max_body_bytes)
        except OpenAIError as exc:
            raise AnthropicError.of(exc) from exc
