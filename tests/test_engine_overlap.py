"""Async scheduling (EngineConfig.async_scheduling) on the real SmolLM2 GGUF (fp32, CPU): an engine that
launches step n+1 before applying step n's tokens gives exactly the outputs of the step-by-step engine.

Covered: greedy and seeded top-p sampling, grammar-constrained rows, penalties (which wait for their tokens),
logprobs, stop strings and EOS found one step late (the speculative step's token is dropped), max_tokens 1,
chunked prefill under a small budget, preemption in a small pool, and an abort while a step is in flight.
Every run ends with a clean pool audit, and the scheduler's invariants hold after every step.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

import pytest
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import LLMEngine
from pdserve.shared.engine.sampling_params import Constraint, SamplingParams
from pdserve.shared.model.loader import LoadedModel
from pdserve.shared.node.node_protocol import StepOutput
from pdserve.shared.types import RequestId

pytestmark = pytest.mark.slow

TEXTS = (
    "The history of the bicycle begins in",
    "Here is a short poem about the sea:\n",
    "To bake bread at home, you will need",
    "The three laws of motion, stated simply, are",
    "My favourite city in the world is",
    "Q: What is the capital of France?\nA:",
)


def _engine(loaded: LoadedModel, overlap: bool, num_kv_blocks: int = 128, budget: int = 2048) -> LLMEngine:
    cfg = EngineConfig(
        model=loaded.source,
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=budget,
        async_scheduling=overlap,
    )
    return LLMEngine(cfg, loaded)


Result = tuple[tuple[int, ...], str, str | None, tuple[tuple[int, float], ...] | None]


def _run(
    engine: LLMEngine,
    work: Sequence[tuple[Sequence[int], SamplingParams]],
    abort_at: dict[int, int] | None = None,
) -> dict[str, Result]:
    """Runs every request to its end; abort_at {request index: step} aborts one after that many steps."""
    ids = [RequestId(f"r{i}") for i in range(len(work))]
    for rid, (prompt, params) in zip(ids, work, strict=True):
        engine.add_request(engine.new_request(rid, prompt, params))
    outs: dict[str, list[StepOutput]] = {str(rid): [] for rid in ids}
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
        steps += 1
        for i, at in (abort_at or {}).items():
            if steps == at:
                aborted = engine.abort(ids[i])
                assert aborted is not None and aborted.finish_reason == "abort"
                outs[ids[i]].append(aborted)
        engine.scheduler.check_invariants()
    audit = engine.audit()
    assert (audit.in_use, audit.reserved) == (0, 0), audit
    result: dict[str, Result] = {}
    for key, got in outs.items():
        assert got and got[-1].finished and not any(o.finished for o in got[:-1]), (key, got)
        lps = None
        if any(o.logprobs is not None for o in got):
            lps = tuple((lp.token_id, round(lp.logprob, 4)) for o in got for lp in (o.logprobs or ()))
        result[key] = (
            tuple(t for o in got for t in o.token_ids),
            "".join(o.text for o in got),
            got[-1].finish_reason,
            lps,
        )
    return result


def _prompts(loaded: LoadedModel) -> list[list[int]]:
    return [loaded.tokenizer.encode(t) for t in TEXTS]


def test_overlap_gives_the_outputs_of_the_step_by_step_engine(loaded: LoadedModel) -> None:
    p = _prompts(loaded)
    work = [
        (p[0], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)),
        (p[1], SamplingParams(max_tokens=40, temperature=0.0, stop=("\n",))),  # a stop string, found late
        (p[2], SamplingParams(max_tokens=1, temperature=0.0)),
        (p[3], SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=7)),
        (p[4], SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5)),
        (p[5], SamplingParams(max_tokens=48, temperature=0.0, logprobs=2)),  # stops at EOS or length
        (p[0], SamplingParams(max_tokens=12, temperature=0.0, stop=(" the",))),
    ]
    want = _run(_engine(loaded, overlap=False), work)
    got = _run(_engine(loaded, overlap=True), work)
    assert got == want
    assert want["r1"][2] == "stop" and want["r6"][2] == "stop"  # the stop strings were hit


def test_overlap_under_chunked_prefill_and_preemption_matches(loaded: LoadedModel) -> None:
    p = _prompts(loaded)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    work = [(q, params) for q in p[:5]]
    want = _run(_engine(loaded, overlap=False), work)
    per_request = max(-(-(len(q) + params.max_tokens) // 16) for q in p[:5])
    small = _engine(loaded, overlap=True, num_kv_blocks=per_request * 2, budget=16)
    got = _run(small, work)
    assert small.scheduler.stats.preemptions > 0
    assert got == want


def test_an_abort_while_a_step_is_in_flight_frees_everything(loaded: LoadedModel) -> None:
    p = _prompts(loaded)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    work = [(q, params) for q in p[:3]]
    want = _run(_engine(loaded, overlap=False), work)
    engine = _engine(loaded, overlap=True)
    got = _run(engine, work, abort_at={1: 5})
    assert got["r0"] == want["r0"] and got["r2"] == want["r2"]
    tokens, _, reason, _ = got["r1"]
    assert reason == "abort" and tokens == want["r1"][0][: len(tokens)]
    assert not engine.scheduler.requests


def test_constrained_rows_under_overlap_match_the_step_by_step_engine(loaded: LoadedModel) -> None:
    """Grammar masks with the overlap on: a constrained row's matcher takes its previous token from the step
    in flight, so outputs equal the step-by-step engine's, mixed with unconstrained rows, seeded or greedy,
    one aborted mid-way; every matcher is gone at the end."""
    p = _prompts(loaded)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
              "rank": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["city", "rank"],
              "additionalProperties": False}  # fmt: skip
    as_json = Constraint("json_schema", json.dumps(schema))
    cities, code = Constraint("choice", '["Paris", "Lyon"]'), Constraint("regex", "[0-9]{3}-[a-z]{4}")
    work = [
        (p[4], SamplingParams(max_tokens=40, temperature=0.0, constraint=as_json)),
        (p[0], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
        (p[5], SamplingParams(max_tokens=8, temperature=0.9, seed=7, constraint=cities)),
        (p[2], SamplingParams(max_tokens=30, temperature=0.8, seed=3, constraint=code)),
        (p[1], SamplingParams(max_tokens=40, temperature=0.0, constraint=as_json)),
    ]  # fmt: skip
    results = []
    for overlap in (False, True):
        engine = _engine(loaded, overlap)
        results.append(_run(engine, work, abort_at={4: 5}))
        assert engine.grammar_matchers() == 0
    plain, out = results
    assert {k: v for k, v in plain.items() if k != "r4"} == {k: v for k, v in out.items() if k != "r4"}
    # the abort lands one step earlier in the overlapped engine's outputs (they come one call late)
    assert plain["r4"][0][: len(out["r4"][0])] == out["r4"][0]
    obj = json.loads(out["r0"][1])
    assert set(obj) == {"city", "rank"} and out["r0"][2] == "stop"
    assert out["r2"][1] in ("Paris", "Lyon") and re.fullmatch("[0-9]{3}-[a-z]{4}", out["r3"][1])
    assert out["r4"][2] == "abort"
