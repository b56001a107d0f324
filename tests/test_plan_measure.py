"""The planner's measurements (cli/plan_measure.py) over plain inputs: Prometheus pages as the router and the
nodes render them, windows between two scrapes, the step line's fit and its priors, a bench result file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pdserve.cli.plan_measure import (
    NODE_SERIES,
    ROUTER_SERIES,
    RateEstimate,
    Scrape,
    Window,
    bench_load,
    parse,
    window,
)
from pdserve.cli.plan_model import Load, Rates
from pdserve.node.node_metrics import NodeMetrics
from pdserve.router.metrics import RouterMetrics
from pdserve.shared.types import KVSource

PRIOR = Rates(prefill_tokens_per_s=1000.0, decode_step_s=0.02, decode_step_s_per_seq=0.001)


def test_parse_reads_the_series_the_router_and_a_node_render() -> None:
    router = RouterMetrics("m")
    router.requests.labels(endpoint="completions", status="200").inc(3)
    router.requests.labels(endpoint="chat", status="400").inc(1)
    router.prefix_hit_tokens.labels(kind=KVSource.MISS).inc(900)
    router.prefix_hit_tokens.labels(kind=KVSource.LOCAL).inc(100)
    router.generation_tokens.inc(40)
    got = parse(router.render().decode(), ROUTER_SERIES)
    assert (got["requests"], got["computed"], got["output"]) == (4, 900, 40)
    node = NodeMetrics("prefill", "m")
    node.prefix_hit_tokens.labels(kind=KVSource.MISS).inc(500)
    node.prefill_done(arrival=0.0, scheduled=1.0, done=1.5, prompt_tokens=500)
    got = parse(node.render().decode(), NODE_SERIES)
    assert (got["computed"], got["prefill_s"]) == (500, 0.5)


def counters(keys: dict[str, tuple[str, tuple[str, str] | None]], **values: float) -> dict[str, float]:
    return dict.fromkeys(keys, 0.0) | values


def test_a_window_measures_load_prefill_rate_and_a_decode_point() -> None:
    old = Scrape(10.0, counters(ROUTER_SERIES), {"p": counters(NODE_SERIES), "d": counters(NODE_SERIES)})
    new = Scrape(
        20.0,
        counters(ROUTER_SERIES, requests=5, computed=5000, output=100),
        {"p": counters(NODE_SERIES, computed=5000, prefill_s=2.5),
         "d": counters(NODE_SERIES, generated=400, itl_sum=2.0, itl_count=400)},
    )  # fmt: skip
    w = window(old, new, {"p": "prefill", "d": "decode"})
    assert w.load == Load(rate=0.5, prompt_tokens=1000, output_tokens=20)
    assert w.prefill_tokens_per_s == 2000
    # 40 tokens/s at 5 ms a step: 0.2 sequences decoding on average
    assert w.decode_points == (pytest.approx((0.2, 0.005)),)


def test_a_counter_that_went_down_gives_no_sample() -> None:
    old = Scrape(
        0.0, counters(ROUTER_SERIES, requests=9), {"p": counters(NODE_SERIES, computed=100, prefill_s=1)}
    )
    new = Scrape(
        5.0, counters(ROUTER_SERIES, requests=2), {"p": counters(NODE_SERIES, computed=10, prefill_s=0.1)}
    )
    w = window(old, new, {"p": "prefill"})
    assert w.load is None and w.prefill_tokens_per_s is None


def test_the_step_line_is_fitted_once_batches_spread_and_keeps_its_priors_until_then() -> None:
    est = RateEstimate(PRIOR)
    assert est.rates() == PRIOR
    est.observe(Window(1.0, None, 3000.0, ((2.0, 0.05),), None, None))
    narrow = est.rates()
    assert (
        narrow.prefill_tokens_per_s == 3000.0 and narrow.decode_step_s_per_seq == PRIOR.decode_step_s_per_seq
    )
    assert narrow.decode_step_s == pytest.approx(0.05 - 2 * 0.001)
    est.observe(Window(1.0, None, None, ((6.0, 0.09),), None, None))
    fitted = est.rates()
    assert fitted.decode_step_s_per_seq == pytest.approx(0.01)
    assert fitted.decode_step_s == pytest.approx(0.03)
    assert fitted.prefill_tokens_per_s == 3000.0


def test_bench_load_reads_the_last_run_and_names_a_bad_file(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    runs = [
        {"completed": 1, "request_throughput": 9.0, "total_input_tokens": 1, "total_output_tokens": 1},
        {"completed": 4, "request_throughput": 2.0, "total_input_tokens": 4000, "total_output_tokens": 400},
    ]
    path.write_text(json.dumps({"runs": runs}))  # fmt: skip
    assert bench_load(str(path)) == Load(rate=2.0, prompt_tokens=1000, output_tokens=100)
    path.write_text("{}")
    with pytest.raises(ValueError, match=r"--bench-result .*bench\.json: not a readable"):
        bench_load(str(path))
