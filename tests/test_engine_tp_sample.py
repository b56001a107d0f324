"""Greedy sampling at tensor-parallel size N on the CPU (gloo), in process (rank 0 here, its workers as real
subprocesses), against TP=1 on the same SmolLM2 weights: a step whose every row is plain greedy moves only
each rank's best (value, index) per row, and gives TP=1's tokens; a step with one row that needs the full
logits (logprobs, a penalty, temperature) gathers them, and gives TP=1's tokens and logprobs. Which path a
step took is read from the runner's step counts (`ModelRunner.outputs`)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import LLMEngine
from pdserve.shared.engine.sampling_params import SamplingParams
from pdserve.shared.model.loader import LoadedModel
from pdserve.shared.model.parallel import best_of_ranks
from pdserve.shared.types import RequestId
from pdserve.tests.harness.cluster_fixture import model_path

pytestmark = pytest.mark.slow

TEXTS = (
    "The history of the bicycle begins in",
    "Q: What is the capital of France?\nA:",
    "def fibonacci(n):\n    ",
)

Result = tuple[tuple[int, ...], tuple[tuple[int, float], ...] | None]


def _run(engine: LLMEngine, work: Sequence[tuple[Sequence[int], SamplingParams]]) -> dict[str, Result]:
    """Every request to its end: its tokens and (when asked) the sampled tokens' logprobs, rounded."""
    for i, (prompt, params) in enumerate(work):
        engine.add_request(engine.new_request(RequestId(f"r{i}"), prompt, params))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(work))}
    lps: dict[str, list[tuple[int, float]]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id].extend(o.token_ids)
            for lp in o.logprobs or ():
                lps.setdefault(o.request_id, []).append((lp.token_id, round(lp.logprob, 3)))
    audit = engine.audit()
    assert (audit.in_use, audit.reserved) == (0, 0), audit
    return {k: (tuple(v), None if k not in lps else tuple(lps[k])) for k, v in tokens.items()}


def _both(loaded: LoadedModel, work: Sequence[tuple[Sequence[int], SamplingParams]], overlap: bool,
          budget: int = 2048) -> tuple[dict[str, Result], dict[str, Result], dict[str, int]]:  # fmt: skip
    """(TP=1's results, TP=3's results, TP=3 rank 0's steps by output kind); `budget`: tokens per step."""
    one_cfg = EngineConfig(model=loaded.source, num_kv_blocks=64, async_scheduling=overlap,
                           max_num_batched_tokens=budget)  # fmt: skip
    one = LLMEngine(one_cfg, loaded)
    try:
        want = _run(one, work)
    finally:
        one.close()
    cfg = EngineConfig(model=model_path(), tensor_parallel_size=3, num_kv_blocks=64, async_scheduling=overlap,
                       max_num_batched_tokens=budget)  # fmt: skip
    three = LLMEngine(cfg)
    try:
        got = _run(three, work)
        outputs = dict(three.runner.outputs)
    finally:
        three.close()
    return want, got, outputs


def test_greedy_steps_gather_only_each_ranks_best_and_give_tp1_tokens(loaded: LoadedModel) -> None:
    prompts = [loaded.tokenizer.encode(t) for t in TEXTS]
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    # async scheduling: the workers' next step reads the tokens of their own all-gather, not a broadcast;
    # 16 tokens a step: the long prompt's first chunk is a step that samples no row (an empty all-gather)
    long = prompts[1] * 3
    assert len(long) > 16
    want, got, outputs = _both(loaded, [(p, greedy) for p in [long, *prompts]], overlap=True, budget=16)
    assert got == want
    assert outputs.get("logits", 0) == 0 and outputs["tokens"] >= 20, outputs


def test_a_row_that_needs_the_logits_makes_its_steps_gather_them(loaded: LoadedModel) -> None:
    p = [loaded.tokenizer.encode(t) for t in TEXTS]
    work = [
        (p[0], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)),
        (p[1], SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)),
        (p[2], SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=1.3, ignore_eos=True)),
        (p[0], SamplingParams(max_tokens=3, temperature=0.8, top_k=20, seed=5, ignore_eos=True)),
        (p[1], SamplingParams(max_tokens=8, temperature=0.0, min_tokens=5, ignore_eos=True)),
    ]
    want, got, outputs = _both(loaded, work, overlap=False)
    assert got == want
    assert want["r1"][1] is not None and len(want["r1"][1]) == 6
    # the first steps hold every kind of row (full logits); once only r0 is left, its steps take the best
    assert outputs["logits"] >= 6 and outputs["tokens"] >= 24 - 8, outputs


def test_the_best_of_the_ranks_is_torchs_argmax_over_the_whole_row() -> None:
    """The cross-rank rule on gathered (value, global index) pairs: the largest value wins, a tie goes to
    the lowest index (the lower rank), as torch's argmax over the whole row does."""
    row = torch.tensor([[1.0, 3.0, 0.0, 3.0, 2.0, 3.0], [0.5, 0.5, 0.5, 0.5, 0.5, 0.5], [0, 0, 0, 0, 1, 9]])
    per_rank = row.view(3, 3, 2).transpose(0, 1)  # [N=3 ranks, S=3 rows, 2 columns each]
    best, idx = per_rank.max(dim=-1)  # [N, S] each rank's first maximum
    starts = torch.arange(3)[:, None] * 2  # [N, 1] each rank's first column
    pairs = torch.stack((best.double(), (idx + starts).double()), dim=-1)  # [N, S, 2]
    assert best_of_ranks(pairs).tolist() == row.argmax(dim=-1).tolist() == [1, 0, 5]
