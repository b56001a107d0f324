"""The one owner of a process's request tracing (OpenTelemetry), shared by the router and the nodes.

A request's trace context travels between processes as a W3C carrier: a `dict[str, str]` holding
`traceparent` (and `tracestate` when there is one), written and read by OpenTelemetry's propagator only, never
parsed here. The router takes the client's carrier (its HTTP headers) or starts a trace, and the node
protocol carries it to P and D (shared/node/node_protocol.py `trace_context`).

Invariants: with no endpoint the process gets `NO_TRACING`, which creates no SDK object (the SDK is not even
imported) and whose calls return at once, so a span site costs one `if tracing.enabled`; spans of work that
already happened are recorded afterwards with their measured start and end (wall-clock nanoseconds), so
tracing never adds a clock read or an await to the engine's or the transfer's path; `shutdown()` flushes
what is still queued and is called once when the process stops.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span as OtelSpan

Carrier = dict[str, str]
"""A W3C trace context as a map: `traceparent` (and `tracestate`)."""
Attributes = Mapping[str, str | int | float | bool]

_EXPORT_DELAY_MS = 500
"""How long finished spans wait to be exported in one batch (the SDK's default is 5 s)."""


def wall_ns(monotonic_s: float) -> int:
    """The wall-clock nanoseconds of a time.monotonic() reading taken in this process (a span's start or
    end measured on the monotonic clock)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


class Span(Protocol):
    """A span still open (the router's request span): its carrier names it as a parent elsewhere."""

    carrier: Carrier | None

    def end(self, attributes: Attributes | None = None) -> None: ...


class Tracing(Protocol):
    enabled: bool

    def start(self, name: str, parent: Mapping[str, str] | None, attributes: Attributes) -> Span:
        """A span starting now, a child of `parent` (None or no traceparent in it: a new trace)."""
        ...

    def record(
        self, name: str, parent: Carrier | None, start_ns: int, end_ns: int, attributes: Attributes
    ) -> Carrier | None:
        """A finished span of `parent`, from start_ns to end_ns (wall-clock ns); its carrier, for children."""
        ...

    def shutdown(self) -> None: ...


class _NoSpan:
    carrier: Carrier | None = None

    def end(self, attributes: Attributes | None = None) -> None:
        return None


_NO_SPAN = _NoSpan()


class _NoTracing:
    """Tracing off: nothing created, nothing exported."""

    enabled = False

    def start(self, name: str, parent: Mapping[str, str] | None, attributes: Attributes) -> Span:
        return _NO_SPAN

    def record(
        self, name: str, parent: Carrier | None, start_ns: int, end_ns: int, attributes: Attributes
    ) -> Carrier | None:
        return None

    def shutdown(self) -> None:
        return None


NO_TRACING: Tracing = _NoTracing()


class _OtelSpan:
    def __init__(self, span: OtelSpan, carrier: Carrier) -> None:
        self._span = span
        self.carrier: Carrier | None = carrier

    def end(self, attributes: Attributes | None = None) -> None:
        if attributes:
            self._span.set_attributes(dict(attributes))
        self._span.end()


class _OtelTracing:
    """Spans exported over OTLP/HTTP (protobuf) in batches by the SDK's background thread."""

    enabled = True

    def __init__(self, endpoint: str, service: str, instance: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        url = endpoint.rstrip("/")
        if not url.endswith("/v1/traces"):  # a collector's base URL, as OTEL_EXPORTER_OTLP_ENDPOINT gives it
            url += "/v1/traces"
        resource = Resource.create({"service.name": service, "service.instance.id": instance})
        self._provider = TracerProvider(resource=resource)
        self._provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=url), schedule_delay_millis=_EXPORT_DELAY_MS)
        )
        self._tracer = self._provider.get_tracer("pdserve")
        self._propagator = TraceContextTextMapPropagator()
        self._in_context = set_span_in_context

    def _context(self, parent: Mapping[str, str] | None) -> Context | None:
        return None if not parent else self._propagator.extract(parent)

    def _carrier(self, span: OtelSpan) -> Carrier:
        carrier: Carrier = {}
        self._propagator.inject(carrier, self._in_context(span))
        return carrier

    def start(self, name: str, parent: Mapping[str, str] | None, attributes: Attributes) -> Span:
        span = self._tracer.start_span(name, self._context(parent), attributes=dict(attributes))
        return _OtelSpan(span, self._carrier(span))

    def record(
        self, name: str, parent: Carrier | None, start_ns: int, end_ns: int, attributes: Attributes
    ) -> Carrier | None:
        span = self._tracer.start_span(
            name, self._context(parent), attributes=dict(attributes), start_time=start_ns
        )
        span.end(end_time=max(start_ns, end_ns))
        return self._carrier(span)

    def shutdown(self) -> None:
        self._provider.shutdown()


def tracing(endpoint: str | None, service: str, instance: str) -> Tracing:
    """The process's tracing: spans to the OTLP/HTTP collector at `endpoint` (its base URL, or the full
    .../v1/traces one), or NO_TRACING when it is None. `service` and `instance` name the process in the
    trace (service.name, service.instance.id)."""
    if endpoint is None:
        return NO_TRACING
    return _OtelTracing(endpoint, service, instance)


def gib_per_s(nbytes: int, seconds: float) -> float:
    """Bandwidth in GiB/s (0 for a zero duration)."""
    return nbytes / seconds / 2**30 if seconds > 0 else 0.0
