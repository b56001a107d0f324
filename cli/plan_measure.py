"""What the planner measures: the load from the router's /metrics (or a `pdserve bench` result file) and the
nodes' rates from their /metrics, as the difference of two scrapes. Parsing and the arithmetic are pure; the
scrape itself (`scrape`) is the one function here that does I/O.

Series read (every one a counter or a histogram's _sum/_count, so a window is a difference of two scrapes):
- router: `pdserve_router_requests_total` (finished requests: the arrival rate of a steady load),
  `pdserve_router_prefix_hit_tokens_total{kind="miss"}` (prompt tokens some node had to compute),
  `pdserve_router_generation_tokens_total`;
- prefill nodes: `pdserve_node_prefix_hit_tokens_total{kind="miss"}` over
  `vllm:request_prefill_time_seconds_sum` (prefill tokens per busy second);
- decode nodes: `vllm:generation_tokens_total` and `vllm:inter_token_latency_seconds` (mean step time t over
  the window and mean batch b = tokens per second * t, Little's law), each window one point of the step
  line t = a + c * b, fitted by least squares over the last `POINTS` windows.
Invariants: a counter that went down (a restarted process) yields no sample for that window, never a
negative rate; a rate not measured yet keeps its prior (the --prefill-tokens-per-s, --decode-step-s and
--decode-step-s-per-seq settings), and a fit whose points do not spread over at least one sequence of batch
keeps the last slope fitted (the prior before any).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import httpx2
from pdserve.cli.plan_model import Load, PlanRole, Rates
from prometheus_client.parser import text_string_to_metric_families

POINTS = 16
"""Decode windows (batch, step time) the step line is fitted over."""

Counters = dict[str, float]
"""A scrape reduced to the sums the planner reads, by key (`series{label="value"}` or `series`)."""

ROUTER_SERIES = {
    "requests": ("pdserve_router_requests_total", None),
    "computed": ("pdserve_router_prefix_hit_tokens_total", ("kind", "miss")),
    "output": ("pdserve_router_generation_tokens_total", None),
    "ttft_sum": ("pdserve_router_time_to_first_token_seconds_sum", None),
    "ttft_count": ("pdserve_router_time_to_first_token_seconds_count", None),
    "itl_sum": ("pdserve_router_inter_token_latency_seconds_sum", None),
    "itl_count": ("pdserve_router_inter_token_latency_seconds_count", None),
}
NODE_SERIES = {
    "computed": ("pdserve_node_prefix_hit_tokens_total", ("kind", "miss")),
    "prefill_s": ("vllm:request_prefill_time_seconds_sum", None),
    "generated": ("vllm:generation_tokens_total", None),
    "itl_sum": ("vllm:inter_token_latency_seconds_sum", None),
    "itl_count": ("vllm:inter_token_latency_seconds_count", None),
}


def parse(text: str, wanted: Mapping[str, tuple[str, tuple[str, str] | None]]) -> Counters:
    """The sums of the `wanted` samples (by sample name and one optional label) in a Prometheus text page."""
    out = dict.fromkeys(wanted, 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            for key, (name, label) in wanted.items():
                if s.name == name and (label is None or s.labels.get(label[0]) == label[1]):
                    out[key] += s.value
    return out


@dataclass(frozen=True)
class Scrape:
    """One scrape: the router's counters and each node's (by node id), at `t` seconds (monotonic)."""

    t: float
    router: Counters
    nodes: Mapping[str, Counters]


def _delta(new: Counters, old: Counters) -> Counters | None:
    d = {k: new[k] - old.get(k, 0.0) for k in new}
    return None if any(v < 0 for v in d.values()) else d


@dataclass(frozen=True)
class Window:
    """What one window between two scrapes measured (None: nothing to measure it from)."""

    seconds: float
    load: Load | None
    prefill_tokens_per_s: float | None
    decode_points: tuple[tuple[float, float], ...]
    observed_ttft_s: float | None
    observed_itl_s: float | None


def window(old: Scrape, new: Scrape, roles: Mapping[str, PlanRole]) -> Window:
    """The load and the rates over the window from `old` to `new`; `roles`: each node's role during it."""
    dt = new.t - old.t
    assert dt > 0, "scrapes must be in time order"
    r = _delta(new.router, old.router)
    load = ttft = itl = None
    if r is not None and r["requests"] > 0:
        n = r["requests"]
        load = Load(rate=n / dt, prompt_tokens=r["computed"] / n, output_tokens=r["output"] / n)
        ttft = r["ttft_sum"] / r["ttft_count"] if r["ttft_count"] else None
        itl = r["itl_sum"] / r["itl_count"] if r["itl_count"] else None
    computed = busy = 0.0
    points: list[tuple[float, float]] = []
    for node_id, role in roles.items():
        if node_id not in new.nodes or node_id not in old.nodes:
            continue
        d = _delta(new.nodes[node_id], old.nodes[node_id])
        if d is None:
            continue
        if role == "prefill":
            computed, busy = computed + d["computed"], busy + d["prefill_s"]
        elif d["itl_count"] > 0 and d["generated"] > 0:
            step_s = d["itl_sum"] / d["itl_count"]
            points.append((d["generated"] / dt * step_s, step_s))
    prefill_rate = computed / busy if busy > 0 and computed > 0 else None
    return Window(dt, load, prefill_rate, tuple(points), ttft, itl)


@dataclass
class RateEstimate:
    """The rates the planner plans with: priors until measured, then the latest prefill rate and the step
    line fitted over the last POINTS decode windows. Owned by one planner loop."""

    prior: Rates
    prefill_tokens_per_s: float | None = None
    slope: float | None = None
    """The last slope fitted from points that spread (a later window without spread keeps it)."""
    points: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=POINTS))

    def observe(self, w: Window) -> None:
        if w.prefill_tokens_per_s is not None:
            self.prefill_tokens_per_s = w.prefill_tokens_per_s
        self.points.extend(w.decode_points)

    def rates(self) -> Rates:
        """The current estimate (the priors where nothing was measured)."""
        rates = self.prior
        if self.prefill_tokens_per_s is not None:
            rates = replace(rates, prefill_tokens_per_s=self.prefill_tokens_per_s)
        if not self.points:
            return rates
        bs, ts = [b for b, _ in self.points], [t for _, t in self.points]
        mean_b, mean_t = sum(bs) / len(bs), sum(ts) / len(ts)
        var = sum((b - mean_b) ** 2 for b in bs)
        if max(bs) - min(bs) >= 1.0 and var > 0:
            fitted = sum((b - mean_b) * (t - mean_t) for b, t in self.points) / var
            self.slope = fitted if fitted > 0 else self.slope
        slope = self.slope or rates.decode_step_s_per_seq
        intercept = mean_t - slope * mean_b
        if intercept <= 0:  # the line through the points passes below zero: keep the mean step, all slope
            intercept, slope = mean_t / 2, mean_t / 2 / max(mean_b, 1.0)
        return replace(rates, decode_step_s=intercept, decode_step_s_per_seq=slope)


def bench_load(path: str) -> Load:
    """The load of the last run in a `pdserve bench --result-file` (its request throughput as the arrival
    rate; prompt tokens as sent, prefix hits not known there)."""
    try:
        with open(path, encoding="utf-8") as f:
            runs = json.load(f)["runs"]
        run = runs[-1]
        done = run["completed"]
        if done <= 0:
            raise ValueError("its last run completed no request")
        return Load(float(run["request_throughput"]), run["total_input_tokens"] / done,
                    run["total_output_tokens"] / done)  # fmt: skip
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(
            f"--bench-result {path}: not a readable `pdserve bench` result file ({exc})"
        ) from exc


async def scrape(
    client: httpx2.AsyncClient,
    t: float,
    router_url: str | None,
    node_urls: Mapping[str, str],
    api_key: str | None,
) -> Scrape:
    """The router's (None: not read) and the nodes' /metrics now; a node that does not answer is left out of
    this scrape (a router that does not answer raises httpx2.HTTPError)."""
    router = dict.fromkeys(ROUTER_SERIES, 0.0)
    if router_url is not None:
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        reply = await client.get(router_url.rstrip("/") + "/metrics", headers=headers)
        reply.raise_for_status()
        router = parse(reply.text, ROUTER_SERIES)
    nodes: dict[str, Counters] = {}
    for node_id, url in node_urls.items():
        try:
            page = await client.get(url.rstrip("/") + "/metrics")
            page.raise_for_status()
        except httpx2.HTTPError:
            continue
        nodes[node_id] = parse(page.text, NODE_SERIES)
    return Scrape(t, router, nodes)
