"""One process's Prometheus registry and the way its series are declared, for the router's metrics
(router/metrics.py) and a node's (node/node_metrics.py).

Invariants: each MetricsRegistry owns its own CollectorRegistry, so several in one process (routers, nodes,
tests) never collide; no `_created` series beside counters and histograms; process and platform metrics on.
"""

from __future__ import annotations

from collections.abc import Sequence

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


class MetricsRegistry:
    """A registry and its declarations; `render()` is the /metrics body."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        disable_created_metrics()
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(name, doc, labels, registry=self.registry)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(name, doc, labels, registry=self.registry)

    def histogram(
        self, name: str, doc: str, buckets: Sequence[float], labels: Sequence[str] = ()
    ) -> Histogram:
        return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
