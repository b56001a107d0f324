"""Prometheus metrics of one router process.

Each RouterMetrics owns its own CollectorRegistry, so several routers (or tests) in one process never
collide. Latencies are seconds as measured by the router (TTFT from the request's arrival to its first
token leaving a node; inter-token latency per token, a step's gap divided by the tokens it carried).
Prefix hits are in tokens, by source (shared/types.py `KVSource`), as the prefilling node reported them for
each request the router placed and sent (a refused request counts nothing): local (its own cache), remote
(fetched from another node), miss (computed, including blocks a planned fetch did not bring). Each
decision's score (token equivalents, see router/policy.py) and its estimate of the prompt tokens the
prefilling node computes are histograms labelled by decision kind and prefilling node.
The request series (latencies, tokens, requests) carry a `model_name` label, the router's first served
name, as the nodes' vllm:* series do.
"""

from __future__ import annotations

from typing import TypeVar

from pdserve.shared.metrics import MetricsRegistry
from pdserve.shared.types import KVSource
from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 600.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
_TOKEN_BUCKETS = (1, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)
_RATIO_BUCKETS = (0.25, 0.5, 0.75, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)
_ROUTING_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)

DECISION_KINDS = ("pd", "local", "single")


class ModelLabelled:
    """A labelled counter whose `model_name` label is fixed: `labels(endpoint=..., status=...)`."""

    def __init__(self, counter: Counter, model_name: str) -> None:
        self._counter = counter
        self._model_name = model_name

    def labels(self, **labels: str) -> Counter:
        return self._counter.labels(model_name=self._model_name, **labels)


_Series = TypeVar("_Series", Counter, Gauge, Histogram)


def _of_model(series: _Series, model_name: str) -> _Series:
    """The child of `series` (labelled by model_name only) that counts this router's model."""
    return series.labels(model_name=model_name)


class RouterMetrics(MetricsRegistry):
    """The router's series; model_name labels the request series."""

    def __init__(self, model_name: str = "") -> None:
        super().__init__()
        hist, counter, gauge = self.histogram, self.counter, self.gauge

        model = ["model_name"]
        self.ttft = _of_model(
            hist(
                "pdserve_router_time_to_first_token_seconds",
                "Request arrival to its first generated token.",
                _LATENCY_BUCKETS,
                model,
            ),
            model_name,
        )
        self.itl = _of_model(
            hist(
                "pdserve_router_inter_token_latency_seconds",
                "Gap between generated tokens of one choice.",
                _ITL_BUCKETS,
                model,
            ),
            model_name,
        )
        self.e2e = _of_model(
            hist(
                "pdserve_router_e2e_request_latency_seconds",
                "Request arrival to its last token.",
                _LATENCY_BUCKETS,
                model,
            ),
            model_name,
        )
        self.tokenize = hist(
            "pdserve_router_tokenize_seconds", "Time to tokenize one prompt.", _ROUTING_BUCKETS
        )
        self.routing = hist(
            "pdserve_router_routing_seconds",
            "Block hashing + index lookup + policy choice for one prompt.",
            _ROUTING_BUCKETS,
        )
        self.prompt_tokens = _of_model(
            counter("pdserve_router_prompt_tokens", "Prompt tokens of served requests.", model), model_name
        )
        self.generation_tokens = _of_model(
            counter("pdserve_router_generation_tokens", "Generated tokens streamed back.", model), model_name
        )
        self.decisions = counter("pdserve_router_decisions", "Routing decisions by kind.", ["kind"])
        self.cost_decisions = counter(
            "pdserve_router_cost_model_decisions",
            "Where each prompt was prefilled, as the cost model's option (router/cost_model.py): local "
            "(on D), pd (P computes), pd_fetch (P fetches a holder's prefix first)",
            ["option"],
        )
        self.cost_estimated_ttft = hist(
            "pdserve_router_cost_model_estimated_ttft_seconds",
            "The cost model's estimate of a choice's time to first token (from its start), by option.",
            _LATENCY_BUCKETS,
            ["option"],
        )
        self.cost_actual_ttft = hist(
            "pdserve_router_cost_model_actual_ttft_seconds",
            "The measured time to first token of the same choices (from the choice's start), by option.",
            _LATENCY_BUCKETS,
            ["option"],
        )
        self.cost_estimate_ratio = hist(
            "pdserve_router_cost_model_estimate_ratio",
            "Each choice's estimated over its measured time to first token, by option (1: exact; the median "
            "within 0.75-1.25 is the model's accuracy target).",
            _RATIO_BUCKETS,
            ["option"],
        )
        self.prefix_hit_tokens = counter(
            "pdserve_router_prefix_hit_tokens",
            "Prompt tokens of placed requests by where their KV came from, as the prefilling node reported.",
            ["kind"],
        )
        self.decision_score = hist(
            "pdserve_router_decision_score",
            "Score of each routing decision, in token equivalents (lower was better).",
            _TOKEN_BUCKETS,
            ["kind", "node_id"],
        )
        self.decision_prefill_tokens = hist(
            "pdserve_router_decision_prefill_tokens",
            "Prompt tokens each decision expects its prefilling node to compute (an estimate).",
            _TOKEN_BUCKETS,
            ["kind", "node_id"],
        )
        self.requests = ModelLabelled(
            counter(
                "pdserve_router_requests",
                "Finished HTTP requests by endpoint and status.",
                ["endpoint", "model_name", "status"],
            ),
            model_name,
        )
        self.in_flight = _of_model(
            gauge("pdserve_router_requests_in_flight", "Client requests being served.", model), model_name
        )
        self.node_in_flight = gauge(
            "pdserve_router_node_requests_in_flight",
            "Node requests (generate or prefill) open per node.",
            ["node_id"],
        )
        self.admission_waits = counter(
            "pdserve_router_admission_waits",
            "Placements that waited because every node of a role was at its in-flight limit.",
        )
        self.index_unavailable = counter(
            "pdserve_router_index_unavailable",
            "Routing decisions made load-only because the Redis index was unreachable.",
        )
        self.aborts = counter(
            "pdserve_router_aborts", "Node requests aborted by the router, by reason.", ["reason"]
        )
        self.migrations = counter(
            "pdserve_router_migrations",
            "Choices continued on another node after they streamed tokens, by cause: drain (the node moved "
            "them, `kvctl drain --migrate`; their KV is fetched from it) or failure (the node died or failed "
            "them; re-prefilled).",
            ["cause"],
        )
        self.migration_prompt_tokens = counter(
            "pdserve_router_migration_prompt_tokens",
            "Prompt tokens (original prompt + tokens already streamed) of continuations, by cause and by "
            "where the prefilling node got their KV: cached (its own), fetched (another node, the draining "
            "one for cause=drain) or computed (prefilled again).",
            ["cause", "source"],
        )
        self.node_requests = counter(
            "pdserve_router_node_requests", "Node requests (generate or prefill) sent, per node.", ["node_id"]
        )
        self.circuit_open = gauge(
            "pdserve_router_node_circuit_open",
            "1 while the node's circuit breaker is open (a refused or reset connection; no request goes "
            "there until its health probe answers), else 0.",
            ["node_id"],
        )
        self.circuit_trips = counter(
            "pdserve_router_node_circuit_trips", "Times the node's circuit breaker opened.", ["node_id"]
        )
        self.index_stale_blocks = gauge(
            "pdserve_router_index_stale_blocks",
            "Block records the index holds for a node minus the blocks the node reported holding at its last "
            "heartbeat (positive: records of evicted blocks; negative: blocks the index does not know).",
            ["node_id"],
        )
        self.invalid_node_records = counter(
            "pdserve_router_invalid_node_records",
            "Node records in the index the router ignored, once per node id and epoch: malformed, unsigned "
            "or signed without the cluster's credential (a rogue or broken writer to Redis), or whose URL "
            "failed the router's challenge.",
        )
        self.stale_decisions = counter(
            "pdserve_router_stale_decisions",
            "Routing decisions that counted on prefix blocks the node turned out not to hold (the index "
            "records they were made on were stale).",
            ["node_id"],
        )  # fmt: skip
        for kind in DECISION_KINDS:
            self.decisions.labels(kind=kind)
        for source in (KVSource.LOCAL, KVSource.REMOTE, KVSource.MISS):
            self.prefix_hit_tokens.labels(kind=source)
