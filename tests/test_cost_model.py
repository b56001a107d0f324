"""The placement cost model (router/cost_model.py), pure: options and their order, what it learns from
observations, and that once it has learned the rates its choice follows them (short prompts on D, a held
prefix fetched, a slow link making P compute)."""

from __future__ import annotations

import pytest
from pdserve.router.admission import AdmissionConfig, Ledger, Load
from pdserve.router.cost_model import CostModel, Inputs, Rates, bucket
from pdserve.shared.types import NodeId

BS = 16


def inputs(tokens: int, **kw: int) -> Inputs:
    base = {"hits_prefill": 0, "hits_decode": 0, "hits_holder": 0, "queued_prefill": 0, "queued_decode": 0}
    return Inputs(tokens, BS, **{**base, **kw})  # type: ignore[arg-type]


def trained(s_per_token: float = 1e-4, fetch: float = 1e-5, send: float = 1e-5) -> CostModel:
    model = CostModel(Rates(), alpha=1.0)
    for n in (64, 512, 4096, 16384):
        model.observe_prefill(n, n, n * s_per_token)
    model.observe_moves(100, 100 * fetch, 100, 100 * send)
    return model


def test_buckets_are_powers_of_two_from_16() -> None:
    assert [bucket(n) for n in (1, 16, 17, 1000, 1024, 1025)] == [16, 16, 32, 1024, 1024, 2048]


def test_every_open_option_is_estimated_cheapest_first() -> None:
    model = trained()
    est = model.estimates(inputs(4096, hits_holder=200))
    assert est[0].option == "pd_fetch" and {e.option for e in est} == {"local", "pd", "pd_fetch"}
    assert est == sorted(est, key=lambda e: e.ttft_s)
    fetch = next(e for e in est if e.option == "pd_fetch")
    assert fetch.fetch_blocks == 200 and fetch.compute_tokens == 4096 - 200 * BS
    assert {e.option for e in model.estimates(inputs(4096))} == {"local", "pd"}  # no holder: no fetch
    assert [e.option for e in model.estimates(inputs(4096, has_prefill_node=False))] == ["local"]


def test_a_prefix_held_elsewhere_is_fetched_by_the_node_that_needs_it() -> None:
    """D fetching the holder's prefix and computing the suffix moves the prefix once; P fetching it must
    also send it on to D: with equal overheads local_fetch is the cheaper, by that send."""
    model = trained()
    x = inputs(16400, hits_holder=1024, hits_holder_decode=1024)
    est = {e.option: e for e in model.estimates(x)}
    assert set(est) == {"local", "local_fetch", "pd", "pd_fetch"} and model.choose(x).option == "local_fetch"
    lf = est["local_fetch"]
    assert lf.fetch_blocks == 1024 and lf.compute_tokens == 16400 - 1024 * BS
    assert est["pd_fetch"].ttft_s - lf.ttft_s == pytest.approx(1025 * 1e-5)
    busy = inputs(16400, hits_holder=1024, hits_holder_decode=1024, queued_decode=60000)
    assert model.choose(busy).option == "pd_fetch"  # D's queue outweighs the second move
    assert "local_fetch" not in {e.option for e in model.estimates(inputs(4096, hits_decode=10))}
    old = Rates.from_json(model.rates.to_json())
    old.overhead_s = {"local": 0.005, "pd": 0.005, "pd_fetch": 0.005}  # written before the option existed
    assert CostModel(old).choose(x).option == "local_fetch"


def test_learned_overheads_put_short_prompts_on_d_and_long_ones_on_p() -> None:
    model = trained()
    short, long = inputs(32), inputs(8192, queued_decode=4000)
    for _ in range(5):  # a P/D round trip measured 20 ms above its compute; a local prefill 2 ms
        for x, option, extra in ((short, "pd", 0.020), (short, "local", 0.002)):
            e = next(e for e in model.estimates(x) if e.option == option)
            model.observe_ttft(e, x, e.ttft_s - model.overhead(e.option) + extra)
    assert model.rates.overhead_s["pd"] == pytest.approx(0.020, rel=1e-6)
    assert model.choose(short).option == "local"
    assert model.choose(long).option == "pd"  # D's queue outweighs the round trip


def test_a_slow_link_makes_computing_cheaper_than_fetching() -> None:
    fast, slow = trained(fetch=1e-5), trained(fetch=1.0)
    x = inputs(2048, hits_holder=120)
    assert fast.choose(x).option == "pd_fetch"
    assert slow.choose(x).option != "pd_fetch"


def test_rates_round_trip_and_estimates_track_observations() -> None:
    model = trained(s_per_token=2e-4)
    again = CostModel(Rates.from_json(model.rates.to_json()))
    x = inputs(3000, hits_holder=50, queued_prefill=100)
    assert [e.ttft_s for e in again.estimates(x)] == [e.ttft_s for e in model.estimates(x)]
    pd = next(e for e in model.estimates(inputs(3000)) if e.option == "pd")
    assert pd.ttft_s == pytest.approx(model.overhead("pd") + 3000 * 2e-4 + 188 * 1e-5)


def test_the_first_observation_of_each_rate_replaces_its_prior() -> None:
    """Priors only stand in until something was measured: one observation sets a rate, later ones average."""
    model = CostModel(Rates(), alpha=0.2)
    assert model.fetch_s_per_block() == model.transfer_s_per_block() == Rates().prior_s_per_block
    model.observe_moves(1000, 0.020, 1025, 0.0041)  # a fetch of 20 us a block; a 4.1 ms transfer tail
    assert model.fetch_s_per_block() == pytest.approx(2e-5)
    assert model.transfer_s_per_block() == pytest.approx(4e-6)
    model.observe_moves(1000, 0.040, 0, 0.0)
    assert model.fetch_s_per_block() == pytest.approx(2e-5 + 0.2 * 2e-5)
    x = inputs(64)
    local = next(e for e in model.estimates(x) if e.option == "local")
    model.observe_ttft(local, x, local.ttft_s + 0.030)  # 30 ms more than the prior overhead explains
    assert model.overhead("local") == pytest.approx(Rates().prior_overhead_s + 0.2 * 0.030)  # it moves
    held = inputs(16400, hits_holder=1024, hits_holder_decode=1024)
    lf = next(e for e in model.estimates(held) if e.option == "local_fetch")
    compute = lf.ttft_s - model.overhead("local_fetch") - 1024 * model.fetch_s_per_block()
    actual = model.overhead("local") + compute + 1024 * 5e-5  # D's fetch took 50 us a block
    model.observe_ttft(lf, held, actual)
    assert model.fetch_s_per_block() == pytest.approx(2.4e-5 + 0.2 * (5e-5 - 2.4e-5))
    before = compute + 1024 * model.fetch_s_per_block() + Rates().prior_overhead_s  # the fetch rate learned
    again = next(e for e in model.estimates(held) if e.option == "local_fetch")
    assert again.ttft_s == pytest.approx(before + 0.2 * (actual - before))


def test_a_prefill_is_a_fixed_cost_plus_a_cost_per_token_fitted_per_bucket() -> None:
    """Suffixes of a cached prefix cost about as much as a step, whatever their length; a line through
    zero (seconds per token) put them at a fraction of it. Two token counts in a bucket identify both."""
    model = CostModel(Rates())
    model.observe_prefill(4400, 4400, 0.030 + 4400 * 2e-5)
    assert model.prefill_line(4400) == pytest.approx(
        (0.0, (0.030 + 4400 * 2e-5) / 4400)
    )  # one count: a ratio
    for tokens in (64, 300, 4096):
        model.observe_prefill(4400, tokens, 0.030 + tokens * 2e-5)
    fixed, per_token = model.prefill_line(4400)
    assert fixed == pytest.approx(0.030) and per_token == pytest.approx(2e-5)
    assert model.prefill_line(7000) == (fixed, per_token)  # the same bucket
    assert model.prefill_line(100) == (fixed, per_token)  # an unseen bucket takes the nearest fitted one
    local = next(
        e for e in model.estimates(inputs(4400, hits_decode=270, queued_decode=100)) if e.option == "local"
    )
    assert local.ttft_s == pytest.approx(model.overhead("local") + 0.030 + (100 + 80) * 2e-5)


def test_queue_depths_are_the_ledgers_booked_prefill_tokens() -> None:
    """The cost model's queues are the tokens this router booked on a prefilling node (P, or D prefilling
    itself) until their first token: bookings add up per node and each gives its tokens back exactly once."""
    ledger = Ledger(AdmissionConfig())
    a, b = NodeId("p0"), NodeId("d0")
    bookings = [ledger.book(b, a, 4096), ledger.book(b, a, 128), ledger.book(b, None, 300)]
    assert (ledger.load(a).prefill_tokens, ledger.load(b).prefill_tokens) == (4224, 300)
    bookings[0].prefill_done()
    bookings[0].release()
    bookings[0].release()
    assert (ledger.load(a).prefill_tokens, ledger.load(b).prefill_tokens) == (128, 300)
    for booking in bookings:
        with booking:
            pass
    assert ledger.load(a) == ledger.load(b) == Load()


def test_an_option_never_observed_is_tried_once_and_then_its_measure_decides() -> None:
    """A pessimistic prior must not stand for good: on a fast link the transfer's prior (per block) made P/D
    look dearer than D's own fetch, P/D was never chosen, so its real cost was never measured."""
    model = trained(fetch=5e-5)
    model.rates.transfer_s_per_block = None  # nothing sent yet: the prior stands in
    x = inputs(16400, hits_prefill=1024, hits_holder_decode=1024)  # P holds the prefix, D holds nothing
    lf = next(e for e in model.estimates(x) if e.option == "local_fetch")
    model.observe_ttft(lf, x, lf.ttft_s)  # D's fetch and its own prefills observed
    model.observe_ttft(next(e for e in model.estimates(inputs(64)) if e.option == "local"), inputs(64), 0.01)
    cheapest = model.estimates(x)[0]
    assert cheapest.option == "local_fetch"  # by the prior: 1025 blocks x 100 us to send
    tried = model.choose(x)
    assert tried.option == "pd" and tried.ttft_s <= 2 * cheapest.ttft_s  # never observed, within 2x: tried
    model.observe_moves(0, 0.0, 1025, 0.0015)  # its transfer tail: 1.5 ms for 1025 blocks
    model.observe_ttft(tried, x, 0.050)
    assert model.choose(x).option == "pd" == model.estimates(x)[0].option  # measured cheaper: chosen on
    model.observe_ttft(model.choose(x), x, 0.500)
    for _ in range(20):
        model.observe_ttft(next(e for e in model.estimates(x) if e.option == "pd"), x, 0.500)
    assert model.choose(x).option == "local_fetch"  # measured dearer: not tried again
    far = trained()
    far.observe_ttft(next(e for e in far.estimates(inputs(64)) if e.option == "local"), inputs(64), 0.001)
    local, pd = far.estimates(inputs(64))
    assert pd.option == "pd" and pd.ttft_s > 2 * local.ttft_s
    assert far.choose(inputs(64)).option == "local"  # pd, unobserved but over twice the cost: not tried
