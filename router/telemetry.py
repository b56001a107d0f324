"""The router's one telemetry sink: the control path (routing, dispatch) emits events and goes on; the
Prometheus series, the cost model's learning, the index's hit statistics and the debug log subscribe.

Invariants: emitting never fails the control path (a failing subscriber is logged, the others still run);
events are frozen values, emitted once each, in the order things happened for one choice (Decided, then its
PrefixHits / PrefillDone / FirstToken, then ChoiceFinished); prefix hits are only ever what the prefilling
node reported for a request that reached it, so a refused request counts nothing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass

from pdserve.router.cost_model import CostModel, Estimate, Inputs
from pdserve.router.metrics import RouterMetrics
from pdserve.router.placement import Selection
from pdserve.shared.node.node_protocol import PrefillResult
from pdserve.shared.types import KVSource, NodeId, RequestId

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decided:
    """One placement decision, `routing_s` seconds of hashing, lookup and choice after its start (time spent
    waiting for room excluded: `admission_wait`, the perf_counter readings when the check for room began and
    ended, the same when a caller built it without one)."""

    selection: Selection
    routing_s: float
    admission_wait: tuple[float, float] = (0.0, 0.0)


@dataclass(frozen=True)
class PrefixHits:
    """Where the KV of one request's prompt came from on its prefilling node, in tokens, as it reported."""

    node_id: NodeId
    local: int
    remote: int
    miss: int

    def by_source(self) -> dict[KVSource, int]:
        return {KVSource.LOCAL: self.local, KVSource.REMOTE: self.remote, KVSource.MISS: self.miss}


@dataclass(frozen=True)
class StaleDecision:
    """A decision counted on prefix blocks its prefilling node turned out not to hold."""

    node_id: NodeId


@dataclass(frozen=True)
class PrefillDone:
    """A prefill node's reply: its compute, fetch and transfer times (the transfer to D is done)."""

    prompt_tokens: int
    block_size: int
    result: PrefillResult


@dataclass(frozen=True)
class FirstToken:
    """A choice's first token, `actual_s` after the choice started, beside the estimate it was placed on."""

    estimate: Estimate
    inputs: Inputs
    actual_s: float


@dataclass(frozen=True)
class ChoiceFinished:
    """A choice's node requests ended (`error`: why, when they failed)."""

    request_id: RequestId
    error: str | None


Event = Decided | PrefixHits | StaleDecision | PrefillDone | FirstToken | ChoiceFinished
Subscriber = Callable[[Event], None]


class Telemetry:
    """Fans each emitted event out to the subscribers, in subscription order."""

    def __init__(self) -> None:
        self._subscribers: list[Subscriber] = []

    def subscribe(self, subscriber: Subscriber) -> None:
        self._subscribers.append(subscriber)

    def emit(self, event: Event) -> None:
        for subscriber in self._subscribers:
            try:
                subscriber(event)
            except Exception:
                log.exception("telemetry subscriber %r failed on %s", subscriber, type(event).__name__)


def metrics_subscriber(m: RouterMetrics) -> Subscriber:
    """The router's Prometheus series (router/metrics.py) from the events."""

    def on(event: Event) -> None:
        match event:
            case Decided(selection=s, routing_s=routing_s):
                m.routing.observe(routing_s)
                m.decisions.labels(kind=s.kind).inc()
                m.decision_score.labels(kind=s.kind, node_id=s.prefilling).observe(s.score)
                m.decision_prefill_tokens.labels(kind=s.kind, node_id=s.prefilling).observe(
                    s.estimate.compute_tokens
                )
                m.cost_decisions.labels(option=s.option).inc()
                m.cost_estimated_ttft.labels(option=s.option).observe(s.estimate.ttft_s)
            case PrefixHits():
                for source, tokens in event.by_source().items():
                    m.prefix_hit_tokens.labels(kind=source).inc(tokens)
            case StaleDecision(node_id=node_id):
                m.stale_decisions.labels(node_id=node_id).inc()
            case FirstToken(estimate=estimate, actual_s=actual):
                m.cost_actual_ttft.labels(option=estimate.option).observe(actual)
                if actual > 0:
                    m.cost_estimate_ratio.labels(option=estimate.option).observe(estimate.ttft_s / actual)

    return on


def cost_learner(cost: CostModel) -> Subscriber:
    """The cost model learns its rates from prefill replies and measured times to first token."""

    def on(event: Event) -> None:
        match event:
            case PrefillDone(prompt_tokens=n, block_size=bs, result=r):
                cost.observe_prefill(n, r.computed_tokens, r.compute_seconds)
                cost.observe_moves(r.fetched_tokens // bs, r.fetch_seconds, r.transferred_blocks,
                                   r.transfer_tail_seconds)  # fmt: skip
            case FirstToken(estimate=estimate, inputs=inputs, actual_s=actual):
                cost.observe_ttft(estimate, inputs, actual)

    return on


def log_events(event: Event) -> None:
    """Each event as one JSON debug line (what replaying the cost model over a logged workload reads)."""
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s %s", type(event).__name__, json.dumps(asdict(event), default=str))
