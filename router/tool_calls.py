"""Tool calling: the request's `tools` / `tool_choice` / `parallel_tool_calls` as a `ToolPlan`, the grammar
that `required` and a named tool impose, the chat template's input (tools and tool turns), and the parsers
that turn the model's text into OpenAI `tool_calls`: `parse_tool_calls` (a whole text) and `ToolCallStream`
(incremental, for `delta.tool_calls`). The parsers are plain functions of text so that other API shapes
(Responses, Messages) can call them.

Invariants: every tool has a JSON schema of its arguments that compiles (else a 400 naming the tool); the
output formats are the ones the plan's constraint or the template produces: `named` -> the arguments object
alone; `required` -> a JSON array of {"name", "arguments"}; `auto` -> the family's format (Hermes
`<tool_call>{json}</tool_call>`, which pdserve's own tool prompt also asks for, or Llama 3.x's bare JSON
`{"name", "parameters"}`). A streamed call's arguments concatenate to exactly the text of the arguments the
model wrote, which is also what the non-streamed call carries. Text the parsers cannot read as a call stays
content. docs/operations.md, "Tool calling", documents the prompt and formats.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pdserve.router.openai_errors import OpenAIError
from pdserve.router.structured_output import checked
from pdserve.shared.engine.sampling_params import Constraint

Choice = Literal["auto", "required", "named"]
ToolFormat = Literal["hermes", "llama3_json", "required", "named"]
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_OPEN, _CLOSE, _PYTHON_TAG = "<tool_call>", "</tool_call>", "<|python_tag|>"
TOOL_PROMPT = (
    "You may call one or more functions to answer. The functions are listed as JSON schemas in <tools>:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with one block per call, and nothing else in it:\n"
    '<tool_call>\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n</tool_call>'
)
"""The system prompt pdserve adds for a chat template that does not render tools (SmolLM2's)."""


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str
    parameters: str
    """The JSON schema of its arguments, as JSON text."""

    def definition(self) -> dict[str, Any]:
        """OpenAI's tool definition, as templates and the tool prompt render it."""
        fn = {"name": self.name, "description": self.description, "parameters": json.loads(self.parameters)}
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[FunctionTool, ...]
    choice: Choice
    name: str | None
    """The function tool_choice names (choice "named")."""
    parallel: bool

    def constraint(self) -> Constraint | None:
        """The grammar `required` and a named tool impose; None for auto."""
        if self.choice == "named":
            tool = next(t for t in self.tools if t.name == self.name)
            return Constraint("json_schema", tool.parameters)
        if self.choice == "auto":
            return None
        items = [
            {
                "type": "object",
                "properties": {"name": {"enum": [t.name]}, "arguments": json.loads(t.parameters)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        return Constraint("json_schema", json.dumps(schema))


def parse_plan(body: dict[str, Any]) -> ToolPlan | None:
    """The plan of a chat body's tool fields (null fields already dropped); None when no tool may be called.
    OpenAIError 400 naming the bad field."""
    tools_raw = body.get("tools") or []
    if not isinstance(tools_raw, list):
        raise OpenAIError(400, "tools must be a list of function tools", param="tools")
    tools = tuple(_tool(i, t) for i, t in enumerate(tools_raw))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise OpenAIError(400, f"tools holds two functions with one name: {names}", param="tools")
    choice_raw = body.get("tool_choice", "auto" if tools else "none")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise OpenAIError(400, "parallel_tool_calls must be true or false", param="parallel_tool_calls")
    if choice_raw == "none":
        return None
    if choice_raw in ("auto", "required"):
        if not tools:
            if choice_raw == "auto":
                return None
            raise OpenAIError(
                400, 'tool_choice "required" needs at least one tool in tools', param="tool_choice"
            )
        return ToolPlan(tools, choice_raw, None, parallel)
    fn = choice_raw.get("function") if isinstance(choice_raw, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(choice_raw, dict) or choice_raw.get("type") != "function" or not isinstance(name, str):
        raise OpenAIError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                          '"function": {"name": ...}}', param="tool_choice")  # fmt: skip
    if name not in names:
        raise OpenAIError(400, f"tool_choice names the function {name!r}, which is not in tools ({names})",
                          param="tool_choice")  # fmt: skip
    return ToolPlan(tools, "named", name, parallel)


def _tool(i: int, raw: Any) -> FunctionTool:
    where = f"tools[{i}]"
    if (
        not isinstance(raw, dict)
        or raw.get("type") != "function"
        or not isinstance(raw.get("function"), dict)
    ):
        raise OpenAIError(400, f'{where} must be {{"type": "function", "function": {{...}}}}', param=where)
    fn = raw["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise OpenAIError(400, f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-'; got "
                          f"{name!r:.80}", param=f"{where}.function.name")  # fmt: skip
    params = fn.get("parameters")
    if not isinstance(params, dict):
        raise OpenAIError(
            400, f"{where}.function.parameters is missing: every tool needs the JSON schema of its arguments "
            f"(function {name!r})", param=f"{where}.function.parameters",
        )  # fmt: skip
    text = json.dumps(params)
    checked(Constraint("json_schema", text), f"{where}.function.parameters")
    description = fn.get("description") or ""
    return FunctionTool(name, description if isinstance(description, str) else "", text)


def check_message_tool_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's tool_calls, checked: [{"id", "type": "function", "function": {"name",
    "arguments": JSON text}}]."""
    where = f"messages[{i}].tool_calls"
    ok = isinstance(calls, list) and all(
        isinstance(c, dict)
        and isinstance(c.get("function"), dict)
        and isinstance(c["function"].get("name"), str)
        and isinstance(c["function"].get("arguments"), str)
        for c in calls
    )
    if not ok:
        raise OpenAIError(400, f'{where} must be a list of {{"id", "type": "function", "function": {{"name", '
                          '"arguments"}}}}', param=where)  # fmt: skip
    return [
        {"id": str(c.get("id") or ""), "type": "function",
         "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
        for c in calls
    ]  # fmt: skip


def tool_format(plan: ToolPlan | None, chat_template: str | None) -> ToolFormat | None:
    """How the output of a request with this plan is read (None: plain text)."""
    if plan is None:
        return None
    if plan.choice != "auto":
        return plan.choice
    template = chat_template or ""
    if _PYTHON_TAG in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def template_input(
    messages: Sequence[dict[str, Any]], plan: ToolPlan | None, chat_template: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and `tools` the chat template renders. A template that renders tools itself gets them
    and the tool turns as they are (arguments as objects, as such templates expect); for one that does not,
    the tools go into the system prompt (TOOL_PROMPT), an assistant's calls into its text as Hermes blocks,
    and a tool result into a `<tool_response>` block."""
    native = chat_template is not None and "tools" in chat_template
    tools = [t.definition() for t in plan.tools] if plan is not None else None
    out: list[dict[str, Any]] = []
    for m in messages:
        calls = m.get("tool_calls")
        if native:
            if calls:
                m = {**m, "tool_calls": [_with_object_arguments(c) for c in calls]}
            out.append(dict(m))
        elif calls:
            blocks = "\n".join(
                f'{_OPEN}\n{{"name": {json.dumps(c["function"]["name"])}, "arguments": '
                f"{c['function']['arguments'] or '{}'}}}\n{_CLOSE}"
                for c in calls
            )
            content = f"{m['content']}\n{blocks}" if m["content"] else blocks
            out.append({"role": "assistant", "content": content})
        elif m["role"] == "tool":
            out.append({"role": "tool", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({k: v for k, v in m.items() if k != "tool_calls"})
    if native or tools is None:
        return out, tools
    prompt = TOOL_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    return {**call, "function": {**fn, "arguments": _loads_or_text(fn["arguments"])}}


def _loads_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _value_end(text: str, start: int) -> int | None:
    """Index just past the JSON value that starts at text[start] (after whitespace), None while it is not
    complete. Tracks only nesting and strings: the text is JSON a grammar or a model wrote, read as it
    grows."""
    depth, in_str, esc, began = 0, False, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                if depth == 0:
                    return i + 1
        elif ch == '"':
            in_str, began = True, True
        elif ch in "{[":
            depth, began = depth + 1, True
        elif ch in "}]":
            depth -= 1
            if depth <= 0:
                return i + 1
        elif ch in ", \n\t\r" and depth == 0 and began:
            return i
        elif not ch.isspace():
            began = True
    return None


@dataclass(frozen=True)
class _Call:
    """One call as read so far: its name (None until complete in the text), its arguments' text so far,
    and whether they are complete."""

    name: str | None
    arguments: str
    complete: bool


def _read_call(text: str, done: bool) -> _Call | None:
    """A call object `{"name": ..., "arguments"|"parameters": ...}` as far as `text` goes; done: the text is
    all there is (a call whose keys come in another order is read whole then). None: not a call."""
    head = _CALL_HEAD.match(text)
    if head is not None:
        name = json.loads(f'"{head.group(1)}"')
        end = _value_end(text, head.end())
        if end is None:
            return _Call(name, text[head.end() :].strip(), False)
        return _Call(name, text[head.end() : end].strip(), True)
    if not done:
        return _Call(None, "", False)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
        return None
    return _Call(obj["name"], json.dumps(args), True)


def _array_items(text: str) -> list[str]:
    """The texts of the top-level items of a JSON array as far as `text` goes (the last may be partial)."""
    start = text.find("[")
    if start < 0:
        return []
    items, i = [], start + 1
    while i < len(text):
        while i < len(text) and text[i] in " \n\t\r,":
            i += 1
        if i >= len(text) or text[i] == "]":
            break
        end = _value_end(text, i)
        items.append(text[i : len(text) if end is None else end])
        if end is None:
            break
        i = end
    return items


def _split(fmt: ToolFormat, text: str, name: str | None, done: bool) -> tuple[str, list[_Call]]:
    """(content, calls) of the text so far; content excludes a trailing partial `<tool_call>` while not
    done."""
    if fmt == "named":
        return "", [_Call(name, text.strip(), done)]
    if fmt == "required":
        return "", [c for c in (_read_call(item, done or _value_end(item, 0) is not None)
                                for item in _array_items(text)) if c is not None]  # fmt: skip
    if fmt == "llama3_json":
        body = text.lstrip()
        if body.startswith(_PYTHON_TAG):
            body = body[len(_PYTHON_TAG) :]
        if not body.lstrip().startswith("{"):
            return ("" if not done and _PYTHON_TAG.startswith(text.strip()) else text), []
        read = [_read_call(part, done) for part in body.split(";") if part.strip()]
        calls = [c for c in read if c is not None]
        return ("", calls) if len(calls) == len(read) else (text, [])
    content, calls, pos = [], [], 0
    while True:
        open_at = text.find(_OPEN, pos)
        if open_at < 0:
            tail = text[pos:]
            if not done:
                for k in range(len(_OPEN) - 1, 0, -1):
                    if tail.endswith(_OPEN[:k]):
                        tail = tail[:-k]
                        break
            content.append(tail)
            break
        content.append(text[pos:open_at])
        close_at = text.find(_CLOSE, open_at)
        inner = text[open_at + len(_OPEN) : len(text) if close_at < 0 else close_at]
        call = _read_call(inner.strip(), done or close_at >= 0)
        if call is None:
            content.append(text[open_at : len(text) if close_at < 0 else close_at + len(_CLOSE)])
        else:
            calls.append(call)
        if close_at < 0:
            break
        pos = close_at + len(_CLOSE)
    return "".join(content), calls


def parse_tool_calls(
    fmt: ToolFormat, text: str, name: str | None = None
) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole output's content (None when it holds only calls) and its OpenAI `tool_calls` (empty: none).
    name: the function of a `named` plan."""
    content, calls = _split(fmt, text, name, True)
    out = [
        {"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
        if c.name is not None
    ]
    content = content.strip() if out else content
    return (content or None) if out else content, out


class ToolCallStream:
    """Reads a streamed output: `feed` each new piece of text, `finish` at the end; each returns the content
    to stream and the `delta.tool_calls` entries (a call's first entry carries its id and name, the next
    ones pieces of its arguments)."""

    def __init__(self, fmt: ToolFormat, name: str | None = None) -> None:
        self.fmt, self.name = fmt, name
        self.text = ""
        self._content = 0
        self._ids: list[str] = []
        self._sent: list[int] = []
        """Characters of each call's arguments already streamed."""

    @property
    def called(self) -> bool:
        return bool(self._ids)

    def feed(self, piece: str) -> tuple[str, list[dict[str, Any]]]:
        self.text += piece
        return self._step(False)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        return self._step(True)

    def _step(self, done: bool) -> tuple[str, list[dict[str, Any]]]:
        content, calls = _split(self.fmt, self.text, self.name, done)
        new_content = content[self._content :]
        self._content = max(self._content, len(content))
        deltas: list[dict[str, Any]] = []
        for i, call in enumerate(calls):
            if call.name is None:
                break
            if i == len(self._ids):
                self._ids.append(new_call_id())
                self._sent.append(0)
                fn = {"name": call.name, "arguments": ""}
                deltas.append({"index": i, "id": self._ids[i], "type": "function", "function": fn})
            more = (
                call.arguments[self._sent[i] :] if call.complete else _stable(call.arguments, self._sent[i])
            )
            if more:
                self._sent[i] += len(more)
                deltas.append({"index": i, "function": {"arguments": more}})
        if self.called and self.fmt != "hermes":
            new_content = ""
        return new_content, deltas


def _stable(arguments: str, sent: int) -> str:
    """The part of partial arguments that can stream now: trailing whitespace waits (a strip may drop it)."""
    return arguments.rstrip()[sent:]
