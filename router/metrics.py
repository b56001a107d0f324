"""Prometheus metrics of one router process.

Each RouterMetrics owns its own CollectorRegistry, so several routers (or tests) in one process never
collide. Latencies are seconds as measured by the router (TTFT from the request's arrival to its first
token leaving a node; inter-token latency per token, a step's gap divided by the tokens it carried).
Prefix hits are in tokens: local (the prefilling node holds them; the index's word at routing time),
remote (fetched from another node: what the prefill node reported as really fetched), miss (computed,
including blocks a fetch was planned for that did not come). Each decision's score (token equivalents,
see router/policy.py) and its estimate of the prompt tokens the prefilling node computes are histograms
labelled by decision kind and prefilling node.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 600.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
_TOKEN_BUCKETS = (1, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)
_ROUTING_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)

DECISION_KINDS = ("pd", "local", "single")
HIT_KINDS = ("local", "remote", "miss")


class RouterMetrics:
    """The router's series; `render()` is the /metrics body."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        disable_created_metrics()  # no `_created` series beside each counter and histogram
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.ttft = Histogram(
            "pdserve_router_time_to_first_token_seconds",
            "Request arrival to its first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pdserve_router_inter_token_latency_seconds",
            "Gap between generated tokens of one choice.",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve_router_e2e_request_latency_seconds",
            "Request arrival to its last token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tokenize = Histogram(
            "pdserve_router_tokenize_seconds",
            "Time to tokenize one prompt.",
            buckets=_ROUTING_BUCKETS,
            registry=r,
        )
        self.routing = Histogram(
            "pdserve_router_routing_seconds",
            "Block hashing + index lookup + policy choice for one prompt.",
            buckets=_ROUTING_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pdserve_router_prompt_tokens", "Prompt tokens of served requests.", registry=r
        )
        self.generation_tokens = Counter(
            "pdserve_router_generation_tokens", "Generated tokens streamed back.", registry=r
        )
        self.decisions = Counter(
            "pdserve_router_decisions", "Routing decisions by kind.", ["kind"], registry=r
        )
        self.prefix_hit_tokens = Counter(
            "pdserve_router_prefix_hit_tokens",
            "Prompt tokens by where their KV was expected at routing time.",
            ["kind"],
            registry=r,
        )
        self.decision_score = Histogram(
            "pdserve_router_decision_score",
            "Score of each routing decision, in token equivalents (lower was better).",
            ["kind", "node_id"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.decision_prefill_tokens = Histogram(
            "pdserve_router_decision_prefill_tokens",
            "Prompt tokens each decision expects its prefilling node to compute (an estimate).",
            ["kind", "node_id"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "pdserve_router_requests",
            "Finished HTTP requests by endpoint and status.",
            ["endpoint", "status"],
            registry=r,
        )
        self.in_flight = Gauge(
            "pdserve_router_requests_in_flight", "Client requests being served.", registry=r
        )
        self.node_in_flight = Gauge(
            "pdserve_router_node_requests_in_flight",
            "Node requests (generate or prefill) open per node.",
            ["node_id"],
            registry=r,
        )
        self.admission_waits = Counter(
            "pdserve_router_admission_waits",
            "Placements that waited because every node of a role was at its in-flight limit.",
            registry=r,
        )
        self.index_unavailable = Counter(
            "pdserve_router_index_unavailable",
            "Routing decisions made load-only because the Redis index was unreachable.",
            registry=r,
        )
        self.aborts = Counter(
            "pdserve_router_aborts", "Node requests aborted by the router, by reason.", ["reason"], registry=r
        )
        self.node_requests = Counter(
            "pdserve_router_node_requests",
            "Node requests (generate or prefill) sent, per node.",
            ["node_id"],
            registry=r,
        )
        self.circuit_open = Gauge(
            "pdserve_router_node_circuit_open",
            "1 while the node's circuit breaker is open (a refused or reset connection; no request goes "
            "there until its health probe answers), else 0.",
            ["node_id"],
            registry=r,
        )
        self.circuit_trips = Counter(
            "pdserve_router_node_circuit_trips",
            "Times the node's circuit breaker opened.",
            ["node_id"],
            registry=r,
        )
        self.index_stale_blocks = Gauge(
            "pdserve_router_index_stale_blocks",
            "Block records the index holds for a node minus the blocks the node reported holding at its last "
            "heartbeat (positive: records of evicted blocks; negative: blocks the index does not know).",
            ["node_id"],
            registry=r,
        )
        self.stale_decisions = Counter(
            "pdserve_router_stale_decisions",
            "Routing decisions that counted on prefix blocks the node turned out not to hold (the index "
            "records they were made on were stale).",
            ["node_id"],
            registry=r,
        )
        for kind in DECISION_KINDS:
            self.decisions.labels(kind=kind)
        for kind in HIT_KINDS:
            self.prefix_hit_tokens.labels(kind=kind)

    def render(self) -> bytes:
        return generate_latest(self.registry)
