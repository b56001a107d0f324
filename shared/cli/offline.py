"""`pdserve generate`: the engine run offline over one or more prompts, all submitted at once so that
several prompts exercise continuous batching. Prints text, or JSON with token ids and logprobs.

A prompt is tokenized exactly as the router tokenizes the same request (chat through the model's template,
raw text with the tokenizer's special tokens), so an offline greedy run is the reference for served output.
Each prompt carries its own SamplingParams: the command line's, with a prompts-file line's overrides."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.shared.engine.sampling_params import SamplingParams
from pdserve.shared.types import FinishReason, RequestId

if TYPE_CHECKING:  # the engine (torch) loads in `run`: prompts are read and checked before it
    from pdserve.shared.engine.config import EngineConfig
    from pdserve.shared.engine.engine import LLMEngine
    from pdserve.shared.node.node_protocol import StepOutput


@dataclass(frozen=True)
class Prompt:
    """Exactly one of `text` (raw completion) or `messages` (chat, through the model's template), and the
    sampling of this prompt."""

    params: SamplingParams
    text: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None

    @staticmethod
    def from_json(obj: Any, defaults: SamplingParams) -> Prompt:
        """One prompts-file line: {"prompt": str} or {"messages": [...]}, plus any SamplingParams field
        (max_tokens, stop, ...) that overrides `defaults` for this prompt alone."""
        if not isinstance(obj, dict) or ("prompt" in obj) == ("messages" in obj):
            raise ValueError(f"each prompt line needs exactly one of 'prompt' or 'messages', got {obj!r:.80}")
        overrides = {k: v for k, v in obj.items() if k not in ("prompt", "messages")}
        params = SamplingParams.from_dict(defaults.to_dict() | overrides) if overrides else defaults
        if "prompt" in obj:
            return Prompt(params, text=str(obj["prompt"]))
        return Prompt(params, messages=parse_messages(obj["messages"]))


def read_prompts_file(path: str, defaults: SamplingParams) -> list[Prompt]:
    """Every non-blank JSON line of `path` (see Prompt.from_json); ValueError names the bad line."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                prompts.append(Prompt.from_json(json.loads(line), defaults))
            except ValueError as exc:  # json.JSONDecodeError is a ValueError
                raise ValueError(f"{path}, line {number}: {exc}") from exc
    return prompts


def parse_messages(raw: Any) -> tuple[dict[str, Any], ...]:
    msgs = json.loads(raw) if isinstance(raw, str) else raw
    if not isinstance(msgs, list) or not msgs:
        raise ValueError("--messages must be a non-empty JSON list of {role, content} objects")
    for m in msgs:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"message {m!r:.80} needs 'role' and 'content'")
    return tuple(msgs)


@dataclass(frozen=True)
class Completion:
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    logprobs: tuple[Any, ...] | None


def tokenize(engine: LLMEngine, prompt: Prompt) -> list[int]:
    tok = engine.tokenizer
    if prompt.messages is not None:
        return tok.apply_chat_template(list(prompt.messages), add_generation_prompt=True)
    assert prompt.text is not None
    return tok.encode(prompt.text, add_special_tokens=True)  # as the router encodes a completion prompt


def generate(engine: LLMEngine, prompts: Sequence[tuple[Sequence[int], SamplingParams]]) -> list[Completion]:
    """Runs every (prompt tokens, sampling) concurrently to completion; validates all before starting any."""
    requests = [
        engine.new_request(RequestId(f"offline-{i}"), ids, params) for i, (ids, params) in enumerate(prompts)
    ]
    for r in requests:
        engine.add_request(r)
    collected: dict[str, list[StepOutput]] = {r.request_id: [] for r in requests}
    while engine.has_unfinished():
        for out in engine.step():
            collected[out.request_id].append(out)
    result = []
    for r in requests:
        outs = collected[r.request_id]
        wants_logprobs = r.params.logprobs is not None
        lps = tuple(lp for o in outs for lp in (o.logprobs or ())) if wants_logprobs else None
        result.append(
            Completion(
                r.prompt_token_ids,
                tuple(t for o in outs for t in o.token_ids),
                "".join(o.text for o in outs),
                outs[-1].finish_reason or "abort",
                lps,
            )
        )
    return result


def run(cfg: EngineConfig, prompts: Sequence[Prompt], as_json: bool) -> int:
    from pdserve.shared.engine.engine import LLMEngine

    t0 = time.perf_counter()
    engine = LLMEngine(cfg)
    load_s = time.perf_counter() - t0
    try:
        completions = generate(engine, [(tokenize(engine, p), p.params) for p in prompts])
    finally:
        engine.close()  # the other tensor-parallel ranks stop on every path
    for c in completions:
        if as_json:
            print(
                json.dumps(
                    {
                        "prompt_token_ids": c.prompt_token_ids,
                        "token_ids": c.token_ids,
                        "text": c.text,
                        "finish_reason": c.finish_reason,
                        "logprobs": None
                        if c.logprobs is None
                        else [
                            {
                                "token_id": lp.token_id,
                                "logprob": lp.logprob,
                                "top": [(t.token_id, t.logprob) for t in lp.top],
                            }
                            for lp in c.logprobs
                        ],
                        "load_seconds": round(load_s, 3),
                    }
                )
            )
        else:
            print(c.text)
    audit = engine.audit()
    assert audit.in_use == 0 and audit.reserved == 0, f"KV blocks leaked: {audit}"
    return 0
