"""Per-request sampling parameters: one frozen, validated value that travels router -> prefill -> decode.

Invariants: every instance is valid (checked in __post_init__, so a bad value fails where it is made, with
the field, the value and the accepted range in the message); the JSON form `to_dict()` round-trips
exactly through `from_dict()`, which refuses unknown keys so a typo on the wire is an error, not a default.
A `Constraint` (structured output) travels inside the params as plain text (a JSON schema, a regex, a list
of choices or an EBNF grammar); the node compiles it (shared/engine/grammar.py), nothing is pickled.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, TypeGuard, get_args

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024
"""Most token ids one request may bias (OpenAI states no bound; this one keeps a request's work small)."""
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: object) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
CONSTRAINT_KINDS: tuple[str, ...] = get_args(ConstraintKind)


@dataclass(frozen=True)
class Constraint:
    """What every sampled token must keep valid: the output is a prefix of a sentence of this language until
    it is complete, and then only an end token may follow."""

    kind: ConstraintKind
    spec: str
    """json_schema: the schema as JSON text; json_object: empty (any JSON object); regex: the pattern;
    choice: a JSON array of the accepted strings; grammar: EBNF text (xgrammar's dialect, GBNF-like)."""

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(
                f"constraint kind {self.kind!r} is not accepted; accepted: {list(CONSTRAINT_KINDS)}"
            )
        if not isinstance(self.spec, str) or (not self.spec and self.kind != "json_object"):
            raise ValueError(f"constraint {self.kind}: its spec must be a non-empty string")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    """Most output tokens to generate (>= 1)."""
    temperature: float = 1.0
    """0 means greedy; otherwise logits are divided by it."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 disables."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p x the top probability; 0 disables."""
    seed: int | None = None
    """Sampling randomness is a function of (seed, position); None lets the node draw from its own RNG."""
    repetition_penalty: float = 1.0
    """> 1 discourages tokens seen in the prompt or output (HF/CTRL style); 1 disables."""
    frequency_penalty: float = 0.0
    """Subtracted from a logit once per earlier occurrence in the output (OpenAI semantics)."""
    presence_penalty: float = 0.0
    """Subtracted from a logit if the token occurs in the output (OpenAI semantics)."""
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    """EOS and stop_token_ids cannot be sampled, and stop strings are not searched, until this many output
    tokens exist (vLLM's semantics); 0 disables. Counted from the first output token, which P samples."""
    logprobs: int | None = None
    """None: no logprobs; N in 0..20: the sampled token's logprob plus the N most likely."""
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias in [-100, 100]) pairs added to those tokens' logits at every step, on P and D alike
    (OpenAI's `logit_bias`); the sampler adds them with the penalties, so logprobs see them too."""
    constraint: Constraint | None = None
    """Structured output: every token is sampled under this grammar's mask (P's first token too)."""

    def __post_init__(self) -> None:
        # Lists arriving from JSON become tuples so the value stays hashable and immutable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(
            self, "logit_bias", tuple(tuple(p) if isinstance(p, list | tuple) else p for p in self.logit_bias)
        )
        self._check_int("max_tokens", self.max_tokens, 1, None, ">= 1")
        self._check_num("temperature", self.temperature, lambda v: v >= 0.0, ">= 0")
        self._check_num("top_p", self.top_p, lambda v: 0.0 < v <= 1.0, "in (0, 1]")
        self._check_int("top_k", self.top_k, 0, None, ">= 0 (0 disables)")
        self._check_int("min_tokens", self.min_tokens, 0, None, ">= 0 (0 disables)")
        self._check_num("min_p", self.min_p, lambda v: 0.0 <= v <= 1.0, "in [0, 1]")
        if self.seed is not None:
            self._check_int("seed", self.seed, _SEED_MIN, _SEED_MAX, "None or an int in [-2**63, 2**64)")
        self._check_num(
            "repetition_penalty", self.repetition_penalty, lambda v: 0.0 < v <= 10.0, "in (0, 10]"
        )
        self._check_num("frequency_penalty", self.frequency_penalty, lambda v: -2.0 <= v <= 2.0, "in [-2, 2]")
        self._check_num("presence_penalty", self.presence_penalty, lambda v: -2.0 <= v <= 2.0, "in [-2, 2]")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop: {s!r} is not accepted; each stop string must be a non-empty str")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids: {t!r} is not accepted; token ids are ints >= 0")
        self._check_logit_bias()
        if self.logprobs is not None:
            self._check_int(
                "logprobs", self.logprobs, 0, MAX_LOGPROBS, f"None or an int in [0, {MAX_LOGPROBS}]"
            )
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} is not accepted; it must be true or false")
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise ValueError(f"constraint={self.constraint!r:.80} is not accepted; it must be a Constraint")

    def _check_logit_bias(self) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias holds {len(self.logit_bias)} tokens; at most {MAX_LOGIT_BIAS}")
        seen: set[int] = set()
        for pair in self.logit_bias:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise ValueError(f"logit_bias: {pair!r} is not accepted; each entry is (token id, bias)")
            token, bias = pair
            if not _is_int(token) or token < 0:
                raise ValueError(f"logit_bias: {token!r} is not accepted; token ids are ints >= 0")
            if token in seen:
                raise ValueError(f"logit_bias holds token id {token} twice")
            seen.add(token)
            if not _is_num(bias) or not -100.0 <= bias <= 100.0:
                raise ValueError(
                    f"logit_bias[{token}]={bias!r} is not accepted; a bias must be a number in [-100, 100]"
                )

    @staticmethod
    def _check_int(name: str, value: object, lo: int, hi: int | None, accepted: str) -> None:
        if not _is_int(value) or value < lo or (hi is not None and value > hi):
            raise ValueError(f"{name}={value!r} is not accepted; {name} must be {accepted}")

    @staticmethod
    def _check_num(name: str, value: object, in_range: Callable[[float], bool], accepted: str) -> None:
        if not _is_num(value) or not in_range(value):
            raise ValueError(f"{name}={value!r} is not accepted; {name} must be a finite number {accepted}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether sampling reads the tokens generated so far (repetition, frequency or presence penalty)."""
        return self.repetition_penalty != 1.0 or bool(self.frequency_penalty) or bool(self.presence_penalty)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (tuples become lists)."""
        out = asdict(self)
        out["stop"] = list(self.stop)
        out["stop_token_ids"] = list(self.stop_token_ids)
        out["logit_bias"] = [list(pair) for pair in self.logit_bias]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplingParams:
        """Inverse of to_dict; missing keys take defaults, unknown keys are a ValueError."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; accepted: {sorted(known)}")
        kwargs = dict(data)
        for key in ("stop", "stop_token_ids", "logit_bias"):
            if key in kwargs:
                value = kwargs[key]
                if isinstance(value, str) or not isinstance(value, list | tuple):
                    raise ValueError(f"{key}={value!r} is not accepted; {key} must be a list")
                kwargs[key] = tuple(tuple(v) if isinstance(v, list | tuple) else v for v in value)
        constraint = kwargs.get("constraint")
        if isinstance(constraint, Mapping):
            if set(constraint) != {"kind", "spec"}:
                raise ValueError(f"constraint={dict(constraint)!r:.80} must hold exactly 'kind' and 'spec'")
            kwargs["constraint"] = Constraint(constraint["kind"], constraint["spec"])
        return cls(**kwargs)
