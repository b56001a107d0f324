"""The state of one client request while it is served: its spec, response head and each choice's progress,
and the context-length check that sets a choice's max_tokens.

Invariants: only the request's own handler task touches it; a choice's text, logprobs and counts grow only
by `record`, one node step at a time, in the order the steps arrived.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.router.dispatch import ChoiceEvent, RequestRun
from pdserve.router.metrics import RouterMetrics
from pdserve.router.openai_builders import ResponseHead, usage
from pdserve.router.openai_protocol import GenerationSpec, OpenAIError
from pdserve.shared.node.node_protocol import TokenLogprob
from pdserve.shared.types import FinishReason


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    offset: int = 0
    last_token_at: float | None = None


@dataclass
class ServedRequest:
    """One client request being served: its spec, routes, response head and per-choice progress."""

    spec: GenerationSpec
    head: ResponseHead
    prompt_lens: list[int]
    echo: list[str]
    run: RequestRun
    arrival: float
    choices: dict[int, ChoiceState]
    first_token_seen: bool = False

    def usage(self) -> dict[str, Any]:
        n = self.spec.n
        done = self.choices.values()
        cached = sum(self.choices[p * n].cached_tokens for p in range(len(self.prompt_lens)))
        return usage(sum(self.prompt_lens), sum(c.completion_tokens for c in done), cached)

    def record(self, event: ChoiceEvent, metrics: RouterMetrics) -> tuple[str, list[TokenLogprob] | None]:
        """Fold a step into its choice; returns (text for the client, this step's logprobs)."""
        step = event.step
        assert step is not None
        choice = self.choices[event.index]
        text = step.text
        if not choice.text and self.echo[event.index // self.spec.n]:
            text = self.echo[event.index // self.spec.n] + text
        choice.text.append(text)
        choice.completion_tokens = step.completion_tokens
        choice.cached_tokens = step.cached_tokens
        choice.finish_reason = step.finish_reason
        now = time.perf_counter()
        if step.token_ids:
            metrics.generation_tokens.inc(len(step.token_ids))
            if not self.first_token_seen:
                self.first_token_seen = True
                metrics.ttft.observe(now - self.arrival)
            if choice.last_token_at is not None:
                for _ in step.token_ids:
                    metrics.itl.observe((now - choice.last_token_at) / len(step.token_ids))
            choice.last_token_at = now
        logprobs = None if step.logprobs is None else list(step.logprobs)
        if logprobs is not None:
            choice.logprobs.extend(logprobs)
        return text, logprobs


def check_length(spec: GenerationSpec, prompt_len: int, limit: int) -> int:
    """max_tokens for one prompt; OpenAIError 400 when prompt + output exceed the context `limit`."""
    max_tokens = spec.max_tokens if spec.max_tokens is not None else limit - prompt_len
    if prompt_len + max(max_tokens, 1) > limit:
        param = "messages" if spec.kind == "chat" else "prompt"
        if prompt_len < limit:
            param = "max_tokens"
        raise OpenAIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
            "completion). Please reduce the prompt or max_tokens.",
            param=param,
            code="context_length_exceeded",
        )
    return max_tokens
