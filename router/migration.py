"""Request migration: a choice whose node fails after it streamed tokens goes on elsewhere, re-prefilled from
its prompt plus the tokens already streamed (Dynamo's request migration), at most `limit` times per choice.

Invariants:
- The continuation's prompt is the original prompt followed by exactly the token ids the client has received
  (in order); its max_tokens is what remains. Sampling randomness is a function of (seed, absolute position)
  (engine/sampler.py), and positions are unchanged by moving tokens from output to prompt, so a greedy or
  seeded choice continues with the text an undisturbed run gives (frequency and presence penalties count
  output tokens only: a choice that uses them is not migrated; nor is a constrained one, whose grammar state
  the new node would start at the streamed tokens).
- Every step the client sees after a migration is rewritten to the original request's view: its prompt
  length, its cached tokens, and completion tokens counted from the original start.
- Pure bookkeeping over plain data; router/dispatch.py decides when to migrate and sends the requests.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pdserve.shared.engine.sampling_params import SamplingParams
from pdserve.shared.node.node_protocol import StepOutput


@dataclass
class Continuation:
    """What one choice has streamed to its client so far (all attempts together)."""

    prompt: tuple[int, ...]
    sampling: SamplingParams
    streamed: list[int] = field(default_factory=list)
    migrations: int = 0
    _base: int = 0
    """Completion tokens streamed by earlier attempts."""
    _cached: int | None = None
    """The first attempt's cached prompt tokens (usage reports the original prompt's)."""

    def eligible(self, limit: int) -> bool:
        """Whether this choice may migrate once more (and has something left to generate)."""
        s = self.sampling
        return (
            self.migrations < limit
            and not s.frequency_penalty
            and not s.presence_penalty
            and s.constraint is None
            and len(self.streamed) < s.max_tokens
        )

    def record(self, step: StepOutput) -> StepOutput:
        """Notes a step going to the client; returns it as the original request would have produced it."""
        if self._cached is None:
            self._cached = step.cached_tokens
        self.streamed.extend(step.token_ids)
        if not self.migrations:
            return step
        return dataclasses.replace(
            step,
            prompt_tokens=len(self.prompt),
            completion_tokens=self._base + step.completion_tokens,
            cached_tokens=self._cached,
        )

    def migrate(self) -> tuple[tuple[int, ...], SamplingParams]:
        """The next attempt's prompt and sampling: the prompt plus every streamed token, what remains to
        generate (and what remains of min_tokens). Call only when eligible."""
        self.migrations += 1
        self._base = len(self.streamed)
        remaining = self.sampling.max_tokens - self._base
        min_tokens = max(0, self.sampling.min_tokens - self._base)
        sampling = dataclasses.replace(self.sampling, max_tokens=remaining, min_tokens=min_tokens)
        return (*self.prompt, *self.streamed), sampling
