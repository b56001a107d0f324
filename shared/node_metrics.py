"""Prometheus metrics of a node process (prefill, decode or single). One registry per process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class NodeMetrics:
    def __init__(self, role: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("pdserve_node_prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter("pdserve_node_generation_tokens", "Tokens generated", registry=r)
        self.prefix_hit_tokens = Counter(
            "pdserve_node_prefix_hit_tokens",
            "Prompt tokens by KV source: local (own cache), transferred (sent by P), miss (computed)",
            ["kind"],
            registry=r,
        )
        self.kv_used_blocks = Gauge("pdserve_node_kv_used_blocks", "KV blocks in use", registry=r)
        self.kv_total_blocks = Gauge("pdserve_node_kv_total_blocks", "KV blocks in the pool", registry=r)
        self.running = Gauge("pdserve_node_running_requests", "Requests running in the engine", registry=r)
        self.waiting = Gauge("pdserve_node_waiting_requests", "Requests queued in the engine", registry=r)
        self.ttft = Histogram(
            "pdserve_node_time_to_first_token_seconds",
            "Arrival to first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pdserve_node_inter_token_latency_seconds",
            "Between output steps",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve_node_e2e_latency_seconds", "Arrival to finish", buckets=LATENCY_BUCKETS, registry=r
        )
        self.transfer_bytes = Counter(
            "pdserve_kv_transfer_bytes", "KV payload bytes moved", ["connector", "direction"], registry=r
        )
        self.transfer_seconds = Histogram(
            "pdserve_kv_transfer_seconds",
            "First send to acknowledgement",
            ["connector"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.transfers = Counter(
            "pdserve_kv_transfers", "Transfers by outcome", ["connector", "outcome"], registry=r
        )
        self.role = Gauge("pdserve_node_info", "Node role", ["role"], registry=r)
        self.role.labels(role).set(1)
