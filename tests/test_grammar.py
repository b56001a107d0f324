"""The grammar engine's wrapper (shared/engine/grammar.py) on SmolLM2's real tokenizer, and the sampler's
use of its masks: a matcher follows a request's output (rolling back when the output is shorter), a batch's
mask leaves unconstrained rows alone, an ended grammar allows only the end token, and min_tokens never
leaves a constrained row with nothing to sample."""

from __future__ import annotations

import json

import pytest
import torch
from pdserve.shared.engine.grammar import GrammarError, Grammars, apply_masks, check
from pdserve.shared.engine.sampler import Sampler, SamplingState
from pdserve.shared.engine.sampling_params import Constraint, SamplingParams
from pdserve.shared.model.loader import load_tokenizer
from pdserve.shared.model.tokenizer import Tokenizer
from pdserve.tests.harness.cluster_fixture import model_path

YES_NO = Constraint("choice", json.dumps(["yes", "no"]))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(model_path())


@pytest.fixture(scope="module")
def grammars(tokenizer: Tokenizer) -> Grammars:
    return Grammars(tokenizer, tokenizer.vocab_size)


def allowed(grammars: Grammars, mask: torch.Tensor, row: int) -> set[int]:
    logits = torch.zeros(mask.shape[0], grammars.vocab_size)
    apply_masks(logits, mask)
    return set((logits[row] > float("-inf")).nonzero().flatten().tolist())


def test_matcher_follows_the_output_and_rolls_back(grammars: Grammars, tokenizer: Tokenizer) -> None:
    m = grammars.matcher(YES_NO)
    first = allowed(grammars, grammars.fill_masks([None, m]), 1)
    assert {tokenizer.decode([t]) for t in first} >= {"yes", "no"}
    assert len(allowed(grammars, grammars.fill_masks([None, m]), 0)) == grammars.vocab_size
    yes = tokenizer.encode("yes")
    m.advance_to(yes)
    assert allowed(grammars, grammars.fill_masks([m]), 0) == set(grammars.stop_ids)
    m.advance_to([])  # the output was shorter: back to the start
    assert m.consumed == 0 and allowed(grammars, grammars.fill_masks([m]), 0) == first
    m.advance_to([*yes, *grammars.stop_ids[:1]])  # ended: only an end token, never xgrammar's error
    assert m.ended and allowed(grammars, grammars.fill_masks([m]), 0) == set(grammars.stop_ids)
    assert grammars.compile(YES_NO) is grammars.compile(YES_NO)


def test_check_names_the_problem_without_native_noise() -> None:
    with pytest.raises(GrammarError, match=r"^the regex constraint does not compile: Regex parsing error"):
        check(Constraint("regex", "(("))
    with pytest.raises(GrammarError, match="choice must be a non-empty list"):
        check(Constraint("choice", "[]"))


def test_min_tokens_gives_way_to_a_grammar_that_only_allows_the_end(grammars: Grammars) -> None:
    """A grammar that is complete allows only EOS; min_tokens holds EOS back: the row must still sample EOS
    (the grammar wins) instead of drawing from all -inf."""
    m = grammars.matcher(YES_NO)
    m.advance_to(load_tokenizer(model_path()).encode("no"))
    mask = grammars.fill_masks([m, m])
    eos = grammars.stop_ids[0]
    sampler = Sampler(eos_token_ids=frozenset(grammars.stop_ids))
    states = [
        SamplingState(SamplingParams(temperature=t, min_tokens=10, seed=1, constraint=YES_NO), (5,), (1,), 2)
        for t in (0.0, 0.7)
    ]
    out = sampler.sample(torch.randn(2, grammars.vocab_size), states, mask)
    assert out.token_ids == (eos, eos)


def test_reused_mask_buffers_give_the_masks_of_fresh_ones(tokenizer: Tokenizer) -> None:
    """The ring of host buffers (allocated once, reused every step) gives each step the mask a fresh buffer
    gives, as rows join, leave, end and the batch grows past the buffers' first size."""
    ring, fresh = Grammars(tokenizer, tokenizer.vocab_size), Grammars(tokenizer, tokenizer.vocab_size)
    json_obj = Constraint("json_object", "")
    a, b = ring.matcher(YES_NO), ring.matcher(json_obj)
    fa, fb = fresh.matcher(YES_NO), fresh.matcher(json_obj)
    yes, brace = tokenizer.encode("yes"), tokenizer.encode("{")
    steps: list[tuple[list[int | None], list[int], list[int]]] = [
        ([0, None, 1], [], []),  # 0: matcher a, 1: matcher b; None: an unconstrained row
        ([1, 0], [], brace),
        ([None, None, None, None, 1], yes, brace),  # a leaves; the batch grows past the first buffers' rows
        ([0], yes, brace),  # a has ended: only end tokens
        ([None, 1, None], yes, brace),
    ]
    for rows, out_a, out_b in steps:
        for m, fm, out in ((a, fa, out_a), (b, fb, out_b)):
            m.advance_to(out)
            fm.advance_to(out)
        got = ring.fill_masks([None if r is None else (a, b)[r] for r in rows]).clone()
        once = Grammars(tokenizer, tokenizer.vocab_size)  # its first mask: a buffer never used before
        want = once.fill_masks([None if r is None else (fa, fb)[r] for r in rows])
        assert got.shape == (len(rows), (tokenizer.vocab_size + 31) // 32)
        assert torch.equal(got, want), rows
