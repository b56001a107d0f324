"""A local OTLP/HTTP trace collector for tests: accepts `POST /v1/traces` (protobuf
ExportTraceServiceRequest, as the OpenTelemetry SDK's OTLP/HTTP exporter sends it), decodes it with
opentelemetry-proto and keeps every span it received.

Owns one ThreadingHTTPServer on a free loopback port, serving from a daemon thread between `start()` and
`stop()` (or a `with` block); `spans()` is a snapshot, safe to call while exporters post.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass(frozen=True)
class Span:
    name: str
    service: str
    trace_id: str
    span_id: str
    parent_span_id: str
    """Hex; "" for a root span."""
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    return None if kind is None else getattr(v, kind)


class OtlpCollector:
    def __init__(self) -> None:
        self._spans: list[Span] = []
        self._lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                request = ExportTraceServiceRequest.FromString(body)
                collector._add(request)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def _add(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            service = str(resource.get("service.name", ""))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    attributes = {a.key: _value(a.value) for a in s.attributes}
                    ids = (s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex())
                    times = (s.start_time_unix_nano, s.end_time_unix_nano)
                    spans.append(Span(s.name, service, *ids, *times, attributes))
        with self._lock:
            self._spans.extend(spans)

    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    def wait_for(self, names: set[str], timeout_s: float = 60.0) -> list[Span]:
        """The spans once every name in `names` arrived (exporters batch every half second); the spans so
        far when timeout_s passed first (the caller's assertions then say what is missing)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not names <= {s.name for s in self.spans()}:
            time.sleep(0.1)
        return self.spans()

    def start(self) -> OtlpCollector:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> OtlpCollector:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
