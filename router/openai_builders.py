"""OpenAI response objects: completions (`text_completion`) and chat (`chat.completion`, `.chunk`).

Shapes follow the schemas in openai-schemas.json (CreateCompletionResponse, CreateChatCompletionResponse,
CreateChatCompletionStreamResponse, CompletionUsage, ChatCompletionTokenLogprob, ListModelsResponse).
One departure, shared with OpenAI's own API: streamed completion chunks carry `finish_reason: null` until
the last chunk of a choice, which that schema (a single shape for both) does not allow. Logprobs are
finite and >= -9999.0 (node_protocol clamps them). A chat choice that called tools carries
`message.tool_calls` (content null when it wrote nothing else) and finish_reason "tool_calls"; its stream
carries `delta.tool_calls` (router/tool_calls.py reads them from the text).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pdserve.router.openai_protocol import Kind
from pdserve.shared.node.node_protocol import TokenLogprob
from pdserve.shared.types import FinishReason

ChoiceFinish = FinishReason | Literal["tool_calls"]
"""A choice's finish_reason as the client sees it: the node's, or "tool_calls" when it called tools."""


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _bytes(value: tuple[int, ...] | None) -> list[int] | None:
    return None if value is None else list(value)


def chat_logprobs(tokens: Sequence[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": t.token,
                "logprob": t.logprob,
                "bytes": _bytes(t.bytes),
                "top_logprobs": [
                    {"token": top.token, "logprob": top.logprob, "bytes": _bytes(top.bytes)} for top in t.top
                ],
            }
            for t in tokens
        ],
        "refusal": None,
    }


def completion_logprobs(tokens: Sequence[TokenLogprob], text_offset: int) -> dict[str, Any]:
    """Legacy completions logprobs; text_offset is where the first token starts in the choice's text."""
    offsets = []
    for t in tokens:
        offsets.append(text_offset)
        text_offset += len(t.token)
    return {
        "tokens": [t.token for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [{top.token: top.logprob for top in t.top} for t in tokens],
        "text_offset": offsets,
    }


def models_response(names: Sequence[str], created: int, max_model_len: int | None) -> dict[str, Any]:
    """The model cards; max_model_len (vLLM's extra field, prompt + output tokens) only when known."""
    extra = {} if max_model_len is None else {"max_model_len": max_model_len}
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "pdserve", **extra}
            for name in names
        ],
    }


@dataclass(frozen=True)
class ResponseHead:
    """What every object of one response shares: id, creation time, model, system fingerprint."""

    kind: Kind
    id: str
    created: int
    model: str
    system_fingerprint: str

    def _head(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
        }

    def choice(
        self,
        index: int,
        text: str | None,
        finish_reason: ChoiceFinish,
        logprobs: Sequence[TokenLogprob] | None,
        offset: int = 0,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """A finished choice of a non-streaming response; offset: completions' text_offset start; text None:
        a chat message that only calls tools."""
        if self.kind == "completion":
            lp = None if logprobs is None else completion_logprobs(logprobs, offset)
            return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {
            "index": index,
            "message": message,
            "logprobs": None if logprobs is None else chat_logprobs(logprobs),
            "finish_reason": finish_reason,
        }

    def response(self, choices: list[dict[str, Any]], usage_: dict[str, Any]) -> dict[str, Any]:
        obj = "text_completion" if self.kind == "completion" else "chat.completion"
        return {**self._head(obj), "choices": sorted(choices, key=lambda c: c["index"]), "usage": usage_}

    def chunk(
        self,
        index: int,
        text: str,
        finish_reason: ChoiceFinish | None,
        logprobs: Sequence[TokenLogprob] | None,
        include_usage: bool,
        offset: int = 0,
        role: bool = False,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """One streamed chunk of one choice. role: the chat stream's opening delta for this choice;
        tool_calls: its `delta.tool_calls` entries."""
        if self.kind == "completion":
            lp = None if logprobs is None else completion_logprobs(logprobs, offset)
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}
            return {**self._head("text_completion"), "choices": [choice]}
        delta: dict[str, Any] = {"role": "assistant", "content": text} if role else {}
        if text and not role:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": None if logprobs is None else chat_logprobs(logprobs),
            "finish_reason": finish_reason,
        }
        out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        if include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage_: dict[str, Any]) -> dict[str, Any]:
        """The last chunk of a stream with include_usage: no choices, the whole request's usage."""
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return {**self._head(obj), "choices": [], "usage": usage_}
