"""Anthropic's Messages API on the router: `POST /v1/messages` (streamed or not) and
`POST /v1/messages/count_tokens`, as translations onto the chat completions path (router/chat_bridge.py).

A request is validated by the pydantic models below, becomes a chat completions body (system -> a system
message, `tool_use` blocks -> assistant tool_calls, `tool_result` blocks -> tool messages, `tools` ->
function tools, `tool_choice` any -> required, `stop_sequences` -> stop), and the chat answer becomes a
Message (text, thinking and tool_use blocks, stop_reason, usage) or Anthropic's stream events
(router/anthropic_events.py).

Invariants: every error leaves in Anthropic's shape with the status the chat path chose; the key is read
from `x-api-key` or `Authorization: Bearer`; stop sequences are asked of the chat path with
include_stop_str_in_output, so that the one that matched is known.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Coroutine
from typing import Annotated, Any, Literal

from pdserve.router.anthropic_events import AnthropicError, to_events, to_message
from pdserve.router.chat_bridge import ChatPath, error_of, read_body, run_chat
from pdserve.router.handler import Incoming, Reply
from pdserve.router.openai_protocol import OpenAIError
from pydantic import BaseModel, ConfigDict, Field, ValidationError


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
