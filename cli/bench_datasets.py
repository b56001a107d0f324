"""Workloads of `pdserve bench`: random lengths, shared prefixes (groups x turns), or a JSONL file.

A workload is built once, before any request is sent, so a served run and an engine run of one command see
the same prompts. A prompt is token ids when a tokenizer made it (sent as ids to /v1/completions, as its
decoded text to chat) or text otherwise; `prompt_len` is its length in the tokenizer's tokens, or in words
for random text (an estimate: the server's count is in its usage reply).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
from pdserve.shared.model.tokenizer import Tokenizer

_TEXT = (
    "the of and to in is was for on that with as by at from his her are be this have it not an which or "
    "river stone light paper window garden engine harbour letter market winter silver forest bridge "
    "quiet early bright narrow distant careful golden open simple heavy"
)
_WORDS = tuple(_TEXT.split())


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: its prompt, prompt length (tokens, or words for random text) and the
    number of tokens to generate (with ignore_eos, exactly that many)."""

    prompt: str | tuple[int, ...]
    prompt_len: int
    output_len: int

    def text(self, tokenizer: Tokenizer | None) -> str:
        """The prompt as text (decoded token ids), for chat messages."""
        if isinstance(self.prompt, str):
            return self.prompt
        if tokenizer is None:
            raise ValueError("token-id prompts need a tokenizer to become chat text; pass --model")
        return tokenizer.decode(self.prompt, skip_special_tokens=False)


@dataclass(frozen=True)
class Lengths:
    """Requested lengths; each drawn uniformly from [len * (1 - range_ratio), len * (1 + range_ratio)]."""

    input_len: int
    output_len: int
    range_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1 or not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(
                f"--input-len {self.input_len} and --output-len {self.output_len} must be >= 1 and "
                f"--range-ratio {self.range_ratio} in [0, 1)"
            )

    def draw(self, rng: np.random.Generator, n: int, length: int) -> list[int]:
        low = max(1, int(length * (1 - self.range_ratio)))
        high = max(low, int(length * (1 + self.range_ratio)))
        return [int(x) for x in rng.integers(low, high + 1, size=n)]


def _tokens(rng: np.random.Generator, tokenizer: Tokenizer | None, n: int) -> str | tuple[int, ...]:
    if tokenizer is None:
        return " ".join(_WORDS[int(i)] for i in rng.integers(0, len(_WORDS), size=n))
    special = tokenizer.eos_token_ids
    ids = rng.integers(0, tokenizer.vocab_size, size=n + len(special))
    return tuple(int(t) for t in ids if int(t) not in special)[:n]


def _join(a: str | tuple[int, ...], b: str | tuple[int, ...]) -> str | tuple[int, ...]:
    if isinstance(a, str) and isinstance(b, str):
        return f"{a} {b}"
    assert isinstance(a, tuple) and isinstance(b, tuple)
    return a + b


def random_requests(
    num_prompts: int, lengths: Lengths, tokenizer: Tokenizer | None, seed: int
) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    ins = lengths.draw(rng, num_prompts, lengths.input_len)
    outs = lengths.draw(rng, num_prompts, lengths.output_len)
    return [BenchRequest(_tokens(rng, tokenizer, i), i, o) for i, o in zip(ins, outs, strict=True)]


def shared_prefix_requests(
    groups: int, turns: int, prefix_len: int, lengths: Lengths, tokenizer: Tokenizer | None, seed: int
) -> list[BenchRequest]:
    """groups x turns requests: each group's prompts share a prefix_len prefix and differ in a suffix of
    about input_len. Ordered turn by turn, so every group's prefix is cached before its next turn."""
    if groups < 1 or turns < 1 or prefix_len < 1:
        raise ValueError(
            f"--prefix-groups {groups}, --prefix-turns {turns}, --prefix-len {prefix_len}: each >= 1"
        )
    rng = np.random.default_rng(seed)
    prefixes = [_tokens(rng, tokenizer, prefix_len) for _ in range(groups)]
    ins = lengths.draw(rng, groups * turns, lengths.input_len)
    outs = lengths.draw(rng, groups * turns, lengths.output_len)
    return [
        BenchRequest(_join(prefixes[g], _tokens(rng, tokenizer, ins[k])), prefix_len + ins[k], outs[k])
        for t in range(turns)
        for g in range(groups)
        for k in [t * groups + g]
    ]


def jsonl_requests(
    path: str, output_len: int, tokenizer: Tokenizer | None, num_prompts: int | None
) -> list[BenchRequest]:
    """Lines of {"prompt": text} or {"prompt_token_ids": [ids]}, each with an optional "output_len"."""
    requests = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            if not isinstance(obj, dict) or ("prompt" in obj) == ("prompt_token_ids" in obj):
                raise ValueError(f"{path}:{n}: need exactly one of 'prompt' or 'prompt_token_ids'")
            out = int(obj.get("output_len", output_len))
            if "prompt_token_ids" in obj:
                ids = tuple(int(t) for t in obj["prompt_token_ids"])
                requests.append(BenchRequest(ids, len(ids), out))
            else:
                text = str(obj["prompt"])
                size = len(tokenizer.encode(text)) if tokenizer else len(text.split())
                requests.append(BenchRequest(text, size, out))
    if not requests:
        raise ValueError(f"{path} holds no prompts; write one JSON object per line")
    return requests[:num_prompts] if num_prompts else requests
