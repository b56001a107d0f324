"""Prometheus metrics of a node process (prefill, decode or single). One registry per process.

Two vocabularies over the same measurements: pdserve's own series (`pdserve_node_*`, `pdserve_kv_*`) and
vLLM's (`vllm:*`, each with a `model_name` label), so dashboards, autoscalers and gateways written for vLLM
read a pdserve node unchanged. Engine-wide values (running, waiting, KV use, preemptions) come from the
latest `EngineSnapshot` (node_stats.py refreshes it every second); per-request latencies are observed where
the request ends. Seconds everywhere; token counts are tokens. No `_created` series; process metrics on.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from pdserve.shared.engine.engine import EngineSnapshot
from pdserve.shared.index.block_index_types import NodeLoad
from pdserve.shared.metrics import MetricsRegistry
from pdserve.shared.types import FinishReason, KVSource, Role
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
VLLM_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                        7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_ENGINE_GAUGES = (  # (the EngineSnapshot / NodeLoad field a gauge shows, its series, its help)
    ("kv_used_blocks", "pdserve_node_kv_used_blocks", "KV blocks in use"),
    ("kv_total_blocks", "pdserve_node_kv_total_blocks", "KV blocks in the pool"),
    ("running", "pdserve_node_running_requests", "Requests running in the engine"),
    ("waiting", "pdserve_node_waiting_requests", "Requests queued in the engine"),
    ("queued_prefill_tokens", "pdserve_node_queued_prefill_tokens",
     "Tokens of the engine's requests not computed yet (prompts left to prefill)"),
)  # fmt: skip


@dataclass(frozen=True)
class RequestTiming:
    """One finished request as a node saw it; times are seconds on one monotonic clock. `scheduled` is when
    this node's engine first computed it (None when its prompt was prefilled elsewhere), `first_token` None
    when it produced no token."""

    arrival: float
    scheduled: float | None
    first_token: float | None
    finished: float
    prompt_tokens: int
    generation_tokens: int
    finish_reason: FinishReason


class NodeMetrics(MetricsRegistry):
    def __init__(
        self, role: Role, model_name: str = "", tp_size: int = 1, devices: tuple[str, ...] = ("cpu",)
    ) -> None:
        super().__init__()
        r = self.registry
        hist, counter, gauge = self.histogram, self.counter, self.gauge
        self.model_name = model_name
        self.engine = EngineSnapshot()
        """The latest engine snapshot (replaced whole by node_stats.py)."""
        self.prompt_tokens = counter("pdserve_node_prompt_tokens", "Prompt tokens received")
        self.generation_tokens = counter("pdserve_node_generation_tokens", "Tokens generated")
        self.prefix_hit_tokens = counter(
            "pdserve_node_prefix_hit_tokens",
            "Prompt tokens by KV source: local (own cache), remote (fetched from another node for this "
            "request), transferred (sent by P), miss (computed)",
            ["kind"],
        )
        self.fetched_blocks = counter(
            "pdserve_node_fetched_blocks",
            "Prefix KV blocks fetched from another node instead of computed (node/kv_fetch.py)",
        )
        self.fetch_miss_blocks = counter(
            "pdserve_node_fetch_miss_blocks",
            "Prefix KV blocks a fetch asked for that did not come (the holder had evicted them, or the fetch "
            "failed); they were computed",
        )
        self.exported_blocks = counter(
            "pdserve_node_exported_blocks", "Prefix KV blocks this node sent to a fetching node"
        )
        self._engine_gauges = {field: gauge(name, doc) for field, name, doc in _ENGINE_GAUGES}
        self.ttft = hist(
            "pdserve_node_time_to_first_token_seconds", "Arrival to first token", LATENCY_BUCKETS
        )
        self.itl = hist("pdserve_node_inter_token_latency_seconds", "Between output steps", LATENCY_BUCKETS)
        self.e2e = hist("pdserve_node_e2e_request_latency_seconds", "Arrival to finish", LATENCY_BUCKETS)
        self.transfer_bytes = counter(
            "pdserve_kv_transfer_bytes", "KV payload bytes moved", ["connector", "direction"]
        )
        self.transfer_seconds = hist(
            "pdserve_kv_transfer_seconds", "First send to acknowledgement", LATENCY_BUCKETS, ["connector"]
        )
        self.transfers = counter("pdserve_kv_transfers", "Transfers by outcome", ["connector", "outcome"])
        self.role = gauge(
            "pdserve_node_info",
            "Node role, tensor-parallel size and each rank's device (comma-separated, rank 0 first)",
            ["role", "tp_size", "devices"],
        )
        self._info_labels = (str(tp_size), ",".join(devices))
        self.role.labels(role, *self._info_labels).set(1)
        self.role_changes = counter(
            "pdserve_node_role_changes",
            "Role changes at run time (`kvctl role`), by the role left and the role taken",
            ["from_role", "to_role"],
        )
        self._vllm = _VllmRequestSeries(r)
        r.register(_VllmEngineView(self))

    def engine_counts(self, counts: EngineSnapshot | NodeLoad) -> None:
        """Sets the engine gauges from one consistent read: a snapshot, or the heartbeat's load (the same)."""
        for field, series in self._engine_gauges.items():
            series.set(getattr(counts, field))

    def role_changed(self, old: Role, new: Role) -> None:
        """The node serves as `new` now: its info series names only the current role."""
        self.role.remove(old, *self._info_labels)
        self.role.labels(new, *self._info_labels).set(1)
        self.role_changes.labels(old, new).inc()

    def first_token(self, seconds: float) -> None:
        """Arrival at this node to its first token leaving it."""
        self.ttft.observe(seconds)
        self._vllm.ttft.labels(self.model_name).observe(seconds)

    def inter_token(self, seconds: float, tokens: int = 1) -> None:
        """Gap between two output steps of one request, the second carrying `tokens` tokens."""
        self.itl.observe(seconds)
        for _ in range(tokens):
            self._vllm.itl.labels(self.model_name).observe(seconds / tokens)

    def request_done(self, t: RequestTiming) -> None:
        """A request this node ended (finished, stopped, aborted or failed)."""
        v, name = self._vllm, self.model_name
        self.e2e.observe(t.finished - t.arrival)
        v.e2e.labels(name).observe(t.finished - t.arrival)
        v.success.labels(name, t.finish_reason).inc()
        v.prompt_len.labels(name).observe(t.prompt_tokens)
        v.generation_len.labels(name).observe(t.generation_tokens)
        if t.scheduled is not None:
            v.queue.labels(name).observe(t.scheduled - t.arrival)
            v.inference.labels(name).observe(t.finished - t.scheduled)
            if t.first_token is not None:
                v.prefill.labels(name).observe(t.first_token - t.scheduled)
        if t.first_token is not None:
            v.decode.labels(name).observe(t.finished - t.first_token)
            if t.generation_tokens > 1:
                v.tpot.labels(name).observe((t.finished - t.first_token) / (t.generation_tokens - 1))

    def prefill_done(self, arrival: float, scheduled: float, done: float, prompt_tokens: int) -> None:
        """A prefill node's part of a request: its queue and prefill time, and its prompt's length."""
        v, name = self._vllm, self.model_name
        v.queue.labels(name).observe(scheduled - arrival)
        v.prefill.labels(name).observe(done - scheduled)
        v.prompt_len.labels(name).observe(prompt_tokens)


class _VllmRequestSeries:
    """vLLM's per-request histograms and counters, labelled by model_name."""

    def __init__(self, r: CollectorRegistry) -> None:
        def hist(name: str, doc: str, buckets: tuple[float, ...] = VLLM_LATENCY_BUCKETS) -> Histogram:
            return Histogram(f"vllm:{name}", doc, ["model_name"], buckets=buckets, registry=r)

        self.ttft = hist("time_to_first_token_seconds", "Histogram of time to first token in seconds.")
        self.itl = hist("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.")
        self.tpot = hist(
            "request_time_per_output_token_seconds", "Histogram of time per output token per request."
        )
        self.e2e = hist("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.")
        self.queue = hist("request_queue_time_seconds", "Time the request spent waiting to be scheduled.")
        self.prefill = hist("request_prefill_time_seconds", "Time from first scheduled to first token.")
        self.decode = hist("request_decode_time_seconds", "Time from first token to the last.")
        self.inference = hist(
            "request_inference_time_seconds", "Time from first scheduled to the last token."
        )
        self.prompt_len = hist("request_prompt_tokens", "Number of prefill tokens processed.", TOKEN_BUCKETS)
        self.generation_len = hist(
            "request_generation_tokens", "Number of generation tokens processed.", TOKEN_BUCKETS
        )
        self.success = Counter(
            "vllm:request_success", "Count of finished requests by finish reason.",
            ["model_name", "finished_reason"], registry=r,
        )  # fmt: skip


class _VllmEngineView(Collector):
    """vLLM's engine-wide series, read at scrape time from the snapshot and pdserve's own counters."""

    def __init__(self, metrics: NodeMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        m, snap, labels = self.m, self.m.engine, [self.m.model_name]
        hits = {
            s.labels["kind"]: s.value
            for f in m.prefix_hit_tokens.collect()
            for s in f.samples
            if s.name.endswith("_total")
        }
        values: list[tuple[type[GaugeMetricFamily | CounterMetricFamily], str, str, float]] = [
            (GaugeMetricFamily, "num_requests_running", "Requests in model execution batches.", snap.running),
            (GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be processed.", snap.waiting),
            (GaugeMetricFamily, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             snap.kv_usage),
            (CounterMetricFamily, "num_preemptions", "Cumulative number of preemptions.", snap.preemptions),
            (CounterMetricFamily, "prefix_cache_queries", "Prefix cache queries, in tokens.",
             sum(hits.values())),
            (CounterMetricFamily, "prefix_cache_hits", "Prefix cache hits, in tokens.",
             hits.get(KVSource.LOCAL, 0.0)),
            (CounterMetricFamily, "prompt_tokens", "Number of prefill tokens processed.",
             _value(m.prompt_tokens)),
            (CounterMetricFamily, "generation_tokens", "Number of generation tokens processed.",
             _value(m.generation_tokens)),
        ]  # fmt: skip
        for family, name, doc, value in values:
            metric = family(f"vllm:{name}", doc, labels=["model_name"])
            metric.add_metric(labels, value)
            yield metric
        yield GaugeMetricFamily(
            "pdserve_node_host_tier_blocks", "KV blocks held in the host-memory tier", value=snap.host_blocks
        )
        yield CounterMetricFamily(
            "pdserve_node_host_tier_offloaded_blocks",
            "KV blocks copied from the device pool into the host tier on eviction",
            value=snap.host_offloaded_blocks,
        )
        yield CounterMetricFamily(
            "pdserve_node_host_tier_restored_blocks",
            "KV blocks copied back from the host tier on a prefix hit instead of being recomputed",
            value=snap.host_restored_blocks,
        )


def _value(counter: Counter) -> float:
    return sum(s.value for f in counter.collect() for s in f.samples if s.name.endswith("_total"))
