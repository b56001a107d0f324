"""The engine over its KV block pool, on the real SmolLM2 GGUF (fp32, CPU): prefix caching and preemption.

A second request sharing a >= 512-token prefix computes only its new tokens (scheduler.stats) and gives
the tokens a fresh engine gives; a pool too small for all requests at once preempts (recompute) and every
request still gives the tokens of an unconstrained run. Every scenario ends with a pool audit: no block
is in use or reserved, and free + cached == all blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from pdserve.shared.cli.offline import Completion, generate
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import LLMEngine
from pdserve.shared.engine.sampling_params import SamplingParams
from pdserve.shared.model.loader import LoadedModel
from pdserve.shared.types import RequestId

pytestmark = pytest.mark.slow
BLOCK = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def _engine(loaded: LoadedModel, num_kv_blocks: int, **kw: int) -> LLMEngine:
    cfg = EngineConfig(model=loaded.source, block_size=BLOCK, num_kv_blocks=num_kv_blocks, **kw)  # type: ignore[arg-type]
    return LLMEngine(cfg, loaded)


def _assert_pool_clean(engine: LLMEngine) -> None:
    audit = engine.audit()
    assert (audit.in_use, audit.reserved) == (0, 0), audit
    assert audit.free + audit.cached == audit.num_blocks == engine.num_blocks, audit
    assert not engine.has_unfinished()


def _run(engine: LLMEngine, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
    out = generate(engine, [(p, params) for p in prompts])
    _assert_pool_clean(engine)
    return out


def _long_prefix(loaded: LoadedModel, min_tokens: int) -> list[int]:
    lines = [
        f"Record {i}: the station at kilometre {17 * i + 3} reported {i % 7 + 2} trains, "
        f"{(i * 13) % 40} minutes of delay and weather code {chr(65 + i % 26)}."
        for i in range(22)
    ]
    ids = loaded.tokenizer.encode("System log follows.\n" + "\n".join(lines) + "\n")
    assert len(ids) >= min_tokens, len(ids)
    return ids


def test_shared_prefix_computes_only_new_tokens(loaded: LoadedModel) -> None:
    tok = loaded.tokenizer
    prefix = _long_prefix(loaded, 600)
    first = prefix + tok.encode("Question: which record had the most trains? Answer:")
    second = prefix + tok.encode(" Summary of the log in one sentence:")
    assert first[len(prefix)] != second[len(prefix)]  # the prompts part at the first suffix token
    engine = _engine(loaded, num_kv_blocks=160)
    stats = engine.scheduler.stats
    _run(engine, [first], GREEDY)
    assert (stats.cached_prompt_tokens, stats.computed_prompt_tokens) == (0, len(first))
    computed_before = stats.computed_prompt_tokens

    [warm] = _run(engine, [second], GREEDY)

    shared = len(prefix) // BLOCK * BLOCK  # full blocks only
    assert shared >= 512
    assert stats.cached_prompt_tokens == shared
    assert stats.computed_prompt_tokens - computed_before == len(second) - shared
    fresh_engine = _engine(loaded, num_kv_blocks=160)
    [fresh] = _run(fresh_engine, [second], GREEDY)
    assert fresh_engine.scheduler.stats.cached_prompt_tokens == 0
    assert warm.token_ids == fresh.token_ids and warm.text == fresh.text
    assert len(warm.token_ids) >= 1


def test_identical_prompt_reuses_all_but_last_token(loaded: LoadedModel) -> None:
    prompt = _long_prefix(loaded, 512)
    engine = _engine(loaded, num_kv_blocks=160)
    [a] = _run(engine, [prompt], GREEDY)
    [b] = _run(engine, [prompt], GREEDY)
    # at least one token is computed so that the step yields logits to sample from
    assert engine.scheduler.stats.cached_prompt_tokens == (len(prompt) - 1) // BLOCK * BLOCK
    assert a.token_ids == b.token_ids


def test_small_pool_preempts_and_every_request_matches_unconstrained(loaded: LoadedModel) -> None:
    tok = loaded.tokenizer
    texts = [
        "The history of the bicycle begins in",
        "Here is a short poem about the sea:\n",
        "To bake bread at home, you will need",
        "The three laws of motion, stated simply, are",
        "My favourite city in the world is",
    ]
    prompts = [tok.encode(t) for t in texts]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    per_request = max(-(-(len(p) + params.max_tokens) // BLOCK) for p in prompts)
    small_blocks = per_request * 2  # room for two requests of five at full length

    roomy = _engine(loaded, num_kv_blocks=128)
    expected = _run(roomy, prompts, params)
    assert roomy.scheduler.stats.preemptions == 0

    small = _engine(loaded, num_kv_blocks=small_blocks)
    got = _run(small, prompts, params)

    assert small.scheduler.stats.preemptions > 0
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert have.finish_reason == "length" and len(have.token_ids) == params.max_tokens
        assert have.token_ids == want.token_ids, f"request {i} changed under preemption"
        assert have.text == want.text


def test_remote_work_waits_while_the_node_runs_max_num_seqs(loaded: LoadedModel) -> None:
    """A decode node takes remote KV (reserve_remote with headroom) only while it could start the request:
    at max_num_seqs live requests, the OPEN waits (the client's first token with it) instead of the request
    being admitted, its first token streamed, and then stalling in the engine's queue."""
    engine = _engine(loaded, num_kv_blocks=64, max_num_seqs=1)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request(engine.new_request(RequestId("local"), loaded.tokenizer.encode("Once upon a"), params))
    engine.step()  # it runs: the one slot is taken, the pool has room
    assert len(engine.scheduler.running) == 1 and not engine.scheduler.waiting
    assert engine.reserve_remote([], 2, headroom=True) is None
    plain = engine.reserve_remote([], 2)  # without headroom (a prefix fetch), the pool's room alone decides
    assert plain is not None
    engine.release_remote(plain)
    while engine.has_unfinished():
        engine.step()
    room = engine.reserve_remote([], 2, headroom=True)
    assert room is not None
    # a reservation not yet admitted (its KV in flight) holds the slot too: a burst of OPENs takes one
    assert engine.reserve_remote([], 2, headroom=True) is None
    engine.release_remote(room)
    again = engine.reserve_remote([], 2, headroom=True)
    assert again is not None
    engine.release_remote(again)
    _assert_pool_clean(engine)


def test_chunked_prefill_under_small_budget_matches_one_shot(loaded: LoadedModel) -> None:
    prompt = _long_prefix(loaded, 512)
    one_shot = _run(_engine(loaded, num_kv_blocks=64), [prompt], GREEDY)
    chunked_engine = _engine(loaded, num_kv_blocks=64, max_num_batched_tokens=48)
    chunked = _run(chunked_engine, [prompt], GREEDY)
    assert chunked[0].token_ids == one_shot[0].token_ids
    assert chunked_engine.scheduler.stats.computed_prompt_tokens == len(prompt)


def test_a_bare_cuda_device_means_gpu_0() -> None:
    """`--device cuda` names GPU 0: the engine binds its threads to a GPU by index (torch.cuda.set_device)."""
    assert EngineConfig(model="m", device="cuda").torch_device == torch.device("cuda", 0)
    assert EngineConfig(model="m", device="cuda:1").torch_device == torch.device("cuda", 1)
    assert EngineConfig(model="m", device="cpu").torch_device == torch.device("cpu")
