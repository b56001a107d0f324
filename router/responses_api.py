"""OpenAI's Responses API on the router: `POST /v1/responses`, streamed or not, as a translation onto the chat
completions path (router/chat_bridge.py).

Input (a string, or message, function_call and function_call_output items) and `instructions` become chat
messages; function tools, `tool_choice`, `text.format` (json_schema / json_object, as response_format),
`max_output_tokens`, temperature and top_p carry over. The chat answer becomes a Response whose output holds
a reasoning item (when the router's reasoning parser found a thought), a message item with its output_text,
and a function_call item per tool call; streamed, the same as Responses events (router/responses_events.py).

Invariants: the server is stateless (`store` is always false in what it returns): `previous_response_id`,
`conversation` and background mode are refused with 400 and a retrieved id is 404, so no client waits on
state that is not kept; every error is OpenAI's ErrorResponse (in a stream, an `error` event).
"""

from __future__ import annotations

from typing import Any, Literal

from pdserve.router.chat_bridge import ChatPath, error_of, read_body, run_chat
from pdserve.router.handler import Incoming, Reply, error_reply
from pdserve.router.openai_protocol import OpenAIError
from pdserve.router.responses_events import ResponseHead, to_events, to_response
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
    messages = _messages(req)
    if not messages:
        raise _bad("input", "there is nothing to answer: send a message item or `instructions`")
    body: dict[str, Any] = {"model": req.model, "messages": messages}
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


def echoed(req: ResponsesRequest) -> dict[str, Any]:
    """The request's fields that every Response of it repeats."""
    fmt = (
        req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else None
    )
    choice: Any = (
        req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunction) else req.tool_choice
    )
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": req.model,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tool_choice": choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
        "text": {"format": fmt or {"type": "text"}},
        "truncation": req.truncation or "disabled",
        "metadata": req.metadata or {},
        "user": req.user,
    }


class ResponsesAPI:
    def __init__(self, chat: ChatPath, max_body_bytes: int) -> None:
        self.chat = chat
        self.max_body_bytes = max_body_bytes

    async def create(self, incoming: Incoming) -> Reply:
        try:
            req = parse_request(await read_body(incoming.body, self.max_body_bytes))
            head = ResponseHead(echoed(req))
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
