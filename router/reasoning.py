"""Reasoning parsers: for models that think before they answer, the text between the thinking tags becomes
`reasoning_content` and only the rest stays `content` (vLLM's `--reasoning-parser`, the router's flag).

`qwen3` (Qwen3, QwQ, DeepSeek-R1-style tags): the output's thought is what follows a `<think>` at its start
(after optional whitespace) up to `</think>`; the blank lines after `</think>` are dropped. An output that
does not open with `<think>` is all content (Qwen3 with `enable_thinking: false`, whose template writes an
empty thought into the prompt); one cut off before `</think>` is all reasoning.

Invariants: a ThinkSplitter fed an output in any cut into deltas emits, in total, exactly what `split`
gives for the whole output (the same state machine serves both), and never emits text that may still turn
out to be part of a tag: that tail is held until the next delta or `finish`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

REASONING_PARSERS = ("qwen3",)
"""The names `--reasoning-parser` accepts."""


@dataclass(frozen=True)
class Tags:
    open: str
    close: str


_TAGS = {"qwen3": Tags("<think>", "</think>")}


def _held(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (it may become the tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ThinkSplitter:
    """Splits one output, delta by delta, into (reasoning, content) deltas."""

    def __init__(self, tags: Tags) -> None:
        self.tags = tags
        self._state: Literal["start", "thinking", "after", "content"] = "start"
        self._buf = ""
        self.opened = False
        """Whether the output opened a thought (so it has reasoning, if an empty one)."""

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) text that `delta` releases."""
        tags, buf = self.tags, self._buf + delta
        reasoning = content = ""
        if self._state == "start":
            stripped = buf.lstrip()
            if stripped.startswith(tags.open):
                self._state, buf, self.opened = "thinking", stripped[len(tags.open) :], True
            elif tags.open.startswith(stripped):
                self._buf = buf
                return "", ""
            else:
                self._state = "content"
        if self._state == "thinking":
            before, found, after = buf.partition(tags.close)
            if found:
                reasoning, buf, self._state = before, after, "after"
            else:
                keep = _held(buf, tags.close)
                reasoning, buf = buf[: len(buf) - keep], buf[len(buf) - keep :]
        if self._state == "after":
            buf = buf.lstrip("\n")
            if buf:
                self._state = "content"
        if self._state == "content":
            content, buf = buf, ""
        self._buf = buf
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held when the output ends: a cut-off tag is text after all."""
        held, self._buf = self._buf, ""
        return (held, "") if self._state == "thinking" else ("", held)


def splitter(name: str) -> ThinkSplitter:
    """A fresh splitter of parser `name`; ValueError naming the accepted ones for another name."""
    if name not in _TAGS:
        raise ValueError(f"reasoning parser {name!r} is not one of {list(REASONING_PARSERS)}")
    return ThinkSplitter(_TAGS[name])


def split(name: str, text: str) -> tuple[str | None, str]:
    """(reasoning or None when the output holds none, content) of a whole output."""
    s = splitter(name)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    reasoning = r1 + r2
    return (reasoning if s.opened else None), c1 + c2


def split_message(name: str, body: dict[str, Any]) -> dict[str, Any]:
    """A chat.completion body with each choice's message split into reasoning_content and content."""
    for choice in body.get("choices", ()):
        message = choice.get("message") or {}
        if isinstance(message.get("content"), str):
            message["reasoning_content"], message["content"] = split(name, message["content"])
    return body


class ChunkSplitter:
    """Splits the chat.completion.chunk objects of one stream, a ThinkSplitter per choice; the reasoning
    goes out as `delta.reasoning_content`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._choices: dict[int, ThinkSplitter] = {}

    def chunk(self, chunk: dict[str, Any]) -> dict[str, Any]:
        for choice in chunk.get("choices", ()):
            delta = choice.get("delta")
            if not isinstance(delta, dict) or "role" in delta:
                continue
            s = self._choices.setdefault(choice.get("index", 0), splitter(self.name))
            reasoning, content = s.feed(delta.pop("content", None) or "")
            if choice.get("finish_reason") is not None:
                r, c = s.finish()
                reasoning, content = reasoning + r, content + c
            if reasoning:
                delta["reasoning_content"] = reasoning
            if content:
                delta["content"] = content
        return chunk
