"""Sampler: greedy, seeded determinism across batch compositions, truncation masks, penalties, logprobs."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
from pdserve.shared.engine.sampler import Sampler, SamplingState, _truncate
from pdserve.shared.engine.sampling_params import SamplingParams

torch.set_num_threads(1)


def state(
    position: int = 3, prompt: tuple[int, ...] = (1, 2), output: tuple[int, ...] = (), **kw: Any
) -> SamplingState:
    return SamplingState(SamplingParams(**kw), prompt, output, position)


def draws(logits_row: torch.Tensor, n: int, **kw: Any) -> torch.Tensor:
    """Tokens drawn at n positions of one seeded request from the same logits row."""
    states = [state(position=p, **kw) for p in range(n)]
    out = Sampler().sample(logits_row[None].repeat(n, 1), states)
    return torch.tensor(out.token_ids)


def test_greedy_is_argmax_row_by_row() -> None:
    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(0))
    states = [state(temperature=0.0), state(temperature=0.7, seed=1), state(temperature=0.0)] + [
        state(temperature=0.0)
    ] * 2
    out = Sampler().sample(logits, states)
    expected = logits.argmax(dim=-1).tolist()
    assert [out.token_ids[i] for i in (0, 2, 3, 4)] == [expected[i] for i in (0, 2, 3, 4)]
    assert out.logprobs == (None,) * 5 and out.top_logprobs == (None,) * 5


def test_same_seed_and_position_give_the_same_token_in_any_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    row = torch.randn(4096, generator=gen) * 2
    target = state(position=17, seed=1234, temperature=0.9, top_p=0.95, top_k=200)
    alone = Sampler().sample(row[None].clone(), [target]).token_ids[0]
    for size in (2, 5, 9):
        others = torch.randn(size, 4096, generator=gen)
        for at in (0, size // 2, size):
            logits = torch.cat([others[:at], row[None], others[at:]])
            states = [state(position=i, seed=i, temperature=1.3, min_p=0.01) for i in range(size)]
            states.insert(at, target)
            assert Sampler(seed=size).sample(logits, states).token_ids[at] == alone
    # Another position of the same request draws independently: many positions cover several tokens.
    assert len(set(draws(row, 64, seed=1234, temperature=0.9).tolist())) > 10


def test_unseeded_requests_follow_the_sampler_rng() -> None:
    logits = torch.zeros(8, 50)
    states = [state(position=0, temperature=1.0)] * 8
    a = Sampler(seed=5).sample(logits, states).token_ids
    assert a == Sampler(seed=5).sample(logits, states).token_ids
    assert len(set(a)) > 1


def test_draws_follow_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    n = 20000
    counts = torch.bincount(draws(probs.log(), n, seed=99), minlength=5).double()
    expected = probs.double() * n
    chi2 = (((counts - expected) ** 2) / expected.clamp(min=1e-9))[:4].sum().item()
    assert counts[4] == 0
    assert chi2 < 16.3  # 3 degrees of freedom, p = 0.001
    # temperature 2 flattens: p ~ p^(1/2)
    flat = probs[:4].sqrt() / probs[:4].sqrt().sum()
    freq = torch.bincount(draws(probs.log(), n, seed=98, temperature=2.0), minlength=5)[:4].double() / n
    assert torch.allclose(freq, flat.double(), atol=0.015)


def test_top_k_top_p_min_p_keep_only_the_allowed_tokens() -> None:
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = probs.log()
    assert set(draws(logits, 3000, seed=1, top_k=2).tolist()) == {0, 1}
    assert set(draws(logits, 3000, seed=2, top_p=0.75).tolist()) == {0, 1, 2}  # 0.4 + 0.25 < 0.75
    assert set(draws(logits, 3000, seed=3, top_p=0.65).tolist()) == {0, 1}
    assert set(draws(logits, 3000, seed=4, min_p=0.3).tolist()) == {0, 1, 2}  # >= 0.12
    # top-p applies to the top-k renormalised distribution: 0.4/0.65 = 0.615 < 0.62
    assert set(draws(logits, 3000, seed=5, top_k=2, top_p=0.62).tolist()) == {0, 1}
    assert set(draws(logits, 3000, seed=6, top_k=2, top_p=0.6).tolist()) == {0}


def reference_truncate(x: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    order = x.argsort(descending=True)
    x = x.clone()
    if top_k:
        x[order[top_k:]] = float("-inf")
    probs = x.softmax(-1)[order]
    before = probs.cumsum(-1) - probs
    drop = order[before >= top_p] if top_p < 1 else order[:0]
    x[drop] = float("-inf")
    return x


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 0.9), (0, 0.999), (300, 0.97), (5, 1.0), (0, 1.0)])
def test_truncation_matches_a_full_sort_even_when_the_nucleus_is_wide(top_k: int, top_p: float) -> None:
    gen = torch.Generator().manual_seed(top_k)
    x = torch.randn(3, 5000, generator=gen) * torch.tensor([[0.3], [3.0], [1.0]])  # flat to peaked
    states = [state(top_k=top_k, top_p=top_p, temperature=1.0)] * 3
    got = _truncate(x, states)
    for r in range(3):
        ref = reference_truncate(x[r], top_k, top_p)
        assert torch.equal(got[r].isinf(), ref.isinf()), (r, got[r].isfinite().sum(), ref.isfinite().sum())
    if top_k == 0 and top_p == 0.999:
        assert got[0].isfinite().sum() > 2048  # the candidate list had to grow past 256 and 2048


def test_penalties_change_logits_as_documented() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0, 1.0]])
    st = state(prompt=(0,), output=(1, 2, 2), repetition_penalty=2.0, logprobs=5)
    lp = Sampler().sample(logits, [st]).top_logprobs[0]
    assert lp is not None
    got = dict(lp)
    expect = torch.log_softmax(torch.tensor([1.0, -2.0, 0.25, 0.0, 1.0]), -1)
    assert all(math.isclose(got[i], expect[i].item(), abs_tol=1e-6) for i in range(5))
    st = state(output=(1, 2, 2), frequency_penalty=0.5, presence_penalty=0.25, logprobs=5)
    got = dict(Sampler().sample(logits, [st]).top_logprobs[0] or ())
    expect = torch.log_softmax(torch.tensor([2.0, -1.0 - 0.75, 0.5 - 1.25, 0.0, 1.0]), -1)
    assert all(math.isclose(got[i], expect[i].item(), abs_tol=1e-6) for i in range(5))
    # a repetition penalty strong enough flips the greedy choice away from a seen token
    assert Sampler().sample(
        logits, [state(output=(0,), temperature=0.0, repetition_penalty=3.0)]
    ).token_ids == (4,)


def test_logprobs_are_of_the_penalised_distribution_before_temperature() -> None:
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(3))  # vocab 20: logprobs=20 is all
    states = [state(temperature=0.0, logprobs=20), state(temperature=0.3, top_k=3, seed=7, logprobs=4)]
    out = Sampler().sample(logits, states)
    full, top4 = out.top_logprobs
    assert full is not None and top4 is not None
    assert math.isclose(sum(math.exp(v) for _, v in full), 1.0, rel_tol=1e-5)
    assert [v for _, v in full] == sorted((v for _, v in full), reverse=True)
    assert full[0][0] == out.token_ids[0] and out.logprobs[0] == full[0][1]
    ref = torch.log_softmax(logits[1], -1)
    assert [t for t, _ in top4] == ref.topk(4).indices.tolist()  # unaffected by temperature and top-k
    assert out.logprobs[1] is not None and math.isclose(
        out.logprobs[1], ref[out.token_ids[1]].item(), abs_tol=1e-6
    )
    none = Sampler().sample(logits[:1], [state(temperature=0.0, logprobs=0)])
    assert none.top_logprobs == ((),) and none.logprobs[0] is not None


def test_bad_logits_are_refused() -> None:
    with pytest.raises(ValueError, match="float32"):
        Sampler().sample(torch.zeros(2, 5, dtype=torch.float16), [state(), state()])
    with pytest.raises(ValueError, match=r"\[1, V\]"):
        Sampler().sample(torch.zeros(2, 5), [state()])
    assert Sampler().sample(torch.zeros(0, 5), []).token_ids == ()


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"max_tokens": 0}, "max_tokens=0"),
        ({"temperature": -0.1}, "temperature=-0.1"),
        ({"top_p": 0.0}, r"top_p=0.0 .* \(0, 1\]"),
        ({"top_k": -1}, "top_k=-1"),
        ({"logprobs": 21}, r"logprobs=21 .*\[0, 20\]"),
        ({"stop": ("",)}, "stop"),
        ({"seed": 2**64}, "seed"),
        ({"ignore_eos": 1}, "ignore_eos=1"),
    ],
)
def test_sampling_params_name_the_bad_value(kw: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)  # type: ignore[arg-type]


def test_sampling_params_round_trip_and_refuse_unknown_keys() -> None:
    p = SamplingParams(
        max_tokens=5, temperature=0.5, seed=3, stop=("a", "bc"), stop_token_ids=(7,), logprobs=2
    )
    assert SamplingParams.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    with pytest.raises(ValueError, match=r"unknown sampling parameter\(s\) \['topp'\]"):
        SamplingParams.from_dict({"topp": 0.5})
    with pytest.raises(ValueError, match="stop='ab'"):
        SamplingParams.from_dict({"stop": "ab"})


def test_min_tokens_holds_back_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.zeros(4, 100)
    logits[:, 7] = 5.0  # the EOS below: the argmax
    logits[:, 9] = 4.0  # a stop token id: next
    logits[:, 3] = 3.0
    prompt = (1, 2)
    states = [
        state(len(prompt), prompt, (), temperature=0.0, min_tokens=2, stop_token_ids=(9,), logprobs=1),
        state(len(prompt) + 1, prompt, (3,), temperature=0.7, seed=1, min_tokens=2, stop_token_ids=(9,)),
        state(len(prompt) + 2, prompt, (3, 3), temperature=0.0, min_tokens=2),  # reached: EOS may come
        state(len(prompt), prompt, (), temperature=0.0),  # no min_tokens
    ]
    out = Sampler(eos_token_ids=frozenset({7})).sample(logits, states)
    assert out.token_ids[0] == 3 and out.token_ids[1] not in (7, 9) and out.token_ids[2:] == (7, 7)
    assert out.top_logprobs[0] is not None and out.top_logprobs[0][0][0] == 7  # logprobs see EOS still


def test_logit_bias_is_added_to_the_row_before_drawing_and_logprobs() -> None:
    logits = torch.zeros(3, 50)
    logits[:, 7] = 5.0
    states = [
        state(temperature=0.0, logit_bias=((12, 100.0),), logprobs=0),  # +100 forces 12
        state(temperature=0.0, logit_bias=((7, -100.0),)),  # -100 bans the argmax: the next is id 0
        state(temperature=0.9, seed=5, logit_bias=((3, 100.0), (7, -100.0))),
    ]
    out = Sampler().sample(logits.clone(), states)
    assert out.token_ids == (12, 0, 3)
    assert out.logprobs[0] is not None and out.logprobs[0] > -1e-3  # the biased distribution's logprob
    assert Sampler().sample(logits[:1].clone(), [state(temperature=0.0)]).token_ids == (7,)  # no bias


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        (((3, 101.0),), r"logit_bias\[3\]=101.0 .* \[-100, 100\]"),
        (((-1, 1.0),), "token ids are ints >= 0"),
        (((3, 1.0), (3, 2.0)), "token id 3 twice"),
    ],
)
def test_logit_bias_names_the_bad_entry(bias: tuple[tuple[int, float], ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias)


def test_logit_bias_round_trips_on_the_wire() -> None:
    p = SamplingParams(logit_bias=((5, -2.5), (9, 100.0)))
    assert SamplingParams.from_dict(json.loads(json.dumps(p.to_dict()))) == p
