"""One request's trace on the router: its request span (the client's `traceparent` as parent, or a new
trace), the spans of its admission wait and routing decisions, and the same stages as one timing line in the
access log at debug level.

It exists only while tracing is on or the access log is at debug level (`RequestTrace.begin` returns None
otherwise, and every site is one `if trace is not None`). The stages arrive as telemetry events
(router/telemetry.py) through `on_event`, which finds the request's trace in `CURRENT`, a context variable
the handler sets around placement and the dispatch sets in each choice's task (tasks copy it when created).
Invariants: the request span ends once (`end`, idempotent), after every stage was recorded; stage times are
perf_counter readings, turned into wall-clock nanoseconds only when a span is recorded.
"""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass, field

from pdserve.router.request_log import REQUEST_ID
from pdserve.router.request_log import log as access_log
from pdserve.router.telemetry import Decided, Event, FirstToken, PrefillDone
from pdserve.shared.tracing import Carrier, Span, Tracing

CURRENT: ContextVar[RequestTrace | None] = ContextVar("request_trace", default=None)
"""The trace of the request whose placement or choice runs in this task (None: not traced)."""


def _wall_ns(perf: float) -> int:
    """Wall-clock ns of a time.perf_counter() reading."""
    return time.time_ns() - int((time.perf_counter() - perf) * 1e9)


@dataclass
class RequestTrace:
    tracing: Tracing
    span: Span
    arrival: float
    """perf_counter at the request's start."""
    request_id: str
    stages: dict[str, float] = field(default_factory=dict)
    """Stage -> milliseconds (summed over choices), for the timing line."""
    ended: bool = False

    @classmethod
    def begin(cls, tracing: Tracing, parent: dict[str, str] | None, endpoint: str) -> RequestTrace | None:
        """The request's trace, or None when neither tracing nor the debug access log wants one."""
        if not tracing.enabled and not access_log.isEnabledFor(logging.DEBUG):
            return None
        request_id = REQUEST_ID.get()
        span = tracing.start(
            "router.request", parent, {"http.route": f"/v1/{endpoint}", "pdserve.request_id": request_id}
        )
        return cls(tracing, span, time.perf_counter(), request_id)

    @property
    def carrier(self) -> Carrier | None:
        """The request span's trace context, for the node requests (None while tracing is off)."""
        return self.span.carrier

    def _add(self, stage: str, seconds: float) -> None:
        self.stages[stage] = self.stages.get(stage, 0.0) + seconds * 1e3

    def _record(self, name: str, start: float, end: float, attributes: dict[str, str | int | float]) -> None:
        if self.tracing.enabled:
            self.tracing.record(name, self.carrier, _wall_ns(start), _wall_ns(end), attributes)

    def on(self, event: Event) -> None:
        now = time.perf_counter()
        match event:
            case Decided(selection=s, routing_s=routing_s, admission_wait=wait):
                waited = wait[1] - wait[0]
                self._add("admission_wait", waited)
                self._add("routing", routing_s)
                self._record("router.admission_wait", wait[0], wait[1], {})
                self._record(
                    "router.routing",
                    now - routing_s - waited,
                    now,
                    {
                        "pdserve.route.kind": s.kind,
                        "pdserve.route.option": s.option,
                        "pdserve.route.score": s.score,
                        "pdserve.route.estimated_ttft_s": s.estimate.ttft_s,
                        "pdserve.route.compute_tokens": s.estimate.compute_tokens,
                        "pdserve.route.decode_node": s.decode,
                        "pdserve.route.prefill_node": s.prefill or "",
                        "pdserve.route.cached_blocks": s.cached_blocks,
                        "pdserve.route.fetch_from": s.fetch_from or "",
                        "pdserve.route.fetch_blocks": s.fetch_blocks,
                    },
                )
            case PrefillDone(result=r):
                self._add("prefill_compute", r.compute_seconds)
                self._add("prefill_fetch", r.fetch_seconds)
                self._add("transfer", r.transfer_seconds)
                self._add("transfer_tail", r.transfer_tail_seconds)
            case FirstToken(actual_s=actual):
                self._add("first_token", actual)

    def end(self, status: int | str) -> None:
        """Ends the request span and logs the timing line (once)."""
        if self.ended:
            return
        self.ended = True
        total_s = time.perf_counter() - self.arrival
        self.span.end({"http.response.status_code": int(status)})
        if access_log.isEnabledFor(logging.DEBUG):
            stages = " ".join(f"{k}={v:.1f}ms" for k, v in self.stages.items())
            access_log.debug("request %s timing: %s total=%.1fms status=%s", self.request_id, stages,
                             total_s * 1e3, status)  # fmt: skip


def on_event(event: Event) -> None:
    """The telemetry subscriber: each event goes to the trace of the request it belongs to, if traced."""
    trace = CURRENT.get()
    if trace is not None:
        trace.on(event)
