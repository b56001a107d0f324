"""A P/D request's trace across processes: a real 1P+1D cluster exporting over OTLP/HTTP to a collector in
the test, one request carrying the client's `traceparent`; every stage's span arrives, all in the client's
trace, each under the right parent across router, P and D, the transfer's with its bytes. The router's
access log has the same stages as one timing line at debug level."""

from __future__ import annotations

import secrets
import subprocess
import sys
from collections.abc import Iterator

import httpx2
import pytest
from pdserve.shared.engine.sampling_params import SamplingParams
from pdserve.shared.node.node_protocol import NodeGenerateRequest, PrefillRequest
from pdserve.shared.types import NodeId, RequestId
from pdserve.tests.harness.cluster_fixture import LiveCluster, served_model_name, up_config
from pdserve.tests.harness.otlp_collector import OtlpCollector, Span

ROUTER = {"router.request", "router.admission_wait", "router.routing"}
PREFILL = {"prefill", "prefill.decode_admission", "prefill.queue", "prefill.compute", "kv_transfer"}
DECODE = {"decode.admission_wait", "decode", "decode.first_token"}


@pytest.fixture(scope="module")
def traced() -> Iterator[tuple[LiveCluster, OtlpCollector]]:
    with OtlpCollector() as collector:
        flags = ("--otlp-endpoint", collector.url)
        cfg = up_config(extra_node_args=flags, router_args=(*flags, "--log-level", "DEBUG"))
        with LiveCluster.start(cfg) as live:
            yield live, collector


def _one(spans: list[Span], name: str) -> Span:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"{len(found)} spans named {name!r}: {[s.name for s in spans]}"
    return found[0]


def test_tracing_off_creates_nothing_and_imports_no_sdk() -> None:
    """Without an endpoint the router handler and the node servers load, and the tracer answers, without the
    OpenTelemetry tracing SDK or its exporter in the process (another library may load the SDK's metrics)."""
    code = (
        "import sys\n"
        "import pdserve.router.handler, pdserve.decode_node.server, pdserve.prefill_node.server\n"
        "from pdserve.shared.tracing import NO_TRACING, tracing\n"
        "t = tracing(None, 'x', 'y')\n"
        "assert t is NO_TRACING and not t.enabled\n"
        "parent = {'traceparent': '00-' + '1' * 32 + '-' + '2' * 16 + '-01'}\n"
        "assert t.start('s', parent, {}).carrier is None\n"
        "assert t.record('s', None, 0, 1, {}) is None\n"
        "sdk = ('opentelemetry.sdk.trace', 'opentelemetry.exporter')\n"
        "print(sorted(m for m in sys.modules if m.startswith(sdk)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_the_trace_context_travels_in_the_node_protocol() -> None:
    carrier = {"traceparent": f"00-{'a' * 32}-{'b' * 16}-01", "tracestate": "k=v"}
    sampling = SamplingParams(max_tokens=4)
    pre = PrefillRequest(RequestId("r"), (1, 2, 3), sampling, None, 1e10, NodeId("d"), "tcp://d:1",
                         trace_context=carrier)  # fmt: skip
    gen = NodeGenerateRequest(
        RequestId("r"), (1, 2, 3), sampling, None, 1e10, NodeId("p"), trace_context=carrier
    )
    assert PrefillRequest.from_json(pre.to_json()).trace_context == carrier
    assert NodeGenerateRequest.from_json(gen.to_json()).trace_context == carrier


@pytest.mark.slow
def test_a_pd_request_is_one_trace_under_the_clients_span(traced: tuple[LiveCluster, OtlpCollector]) -> None:
    live, collector = traced
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    body = {"model": served_model_name(), "prompt": "The tallest mountains of the world are the " * 6,
            "max_tokens": 8, "temperature": 0}  # fmt: skip
    headers = {"traceparent": f"00-{trace_id}-{parent_id}-01"}
    r = httpx2.post(f"{live.base}/v1/completions", json=body, headers=headers, timeout=180)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]

    spans = [s for s in collector.wait_for(ROUTER | PREFILL | DECODE) if s.trace_id == trace_id]
    assert {s.name for s in spans} >= ROUTER | PREFILL | DECODE, sorted(s.name for s in spans)
    assert {s.trace_id for s in collector.spans()} == {trace_id}, "every span is in the client's trace"

    request = _one(spans, "router.request")
    assert request.parent_span_id == parent_id and request.service == "pdserve-router"
    routing = _one(spans, "router.routing")
    for name in ("router.admission_wait", "router.routing", "prefill", "decode", "decode.admission_wait"):
        assert _one(spans, name).parent_span_id == request.span_id, name
    assert routing.attributes["pdserve.route.kind"] == "pd"
    assert routing.attributes["pdserve.route.prefill_node"]
    assert routing.attributes["pdserve.route.decode_node"]
    assert {"pdserve.route.score", "pdserve.route.estimated_ttft_s", "pdserve.route.cached_blocks"} <= set(
        routing.attributes
    )

    prefill = _one(spans, "prefill")
    assert prefill.service == "pdserve-prefill"
    assert prefill.attributes["pdserve.prompt_tokens"] == usage["prompt_tokens"]
    for name in PREFILL - {"prefill"}:
        assert _one(spans, name).parent_span_id == prefill.span_id, name
    transfer = _one(spans, "kv_transfer")
    blocks = transfer.attributes["pdserve.transfer.blocks"]
    assert blocks == -(-usage["prompt_tokens"] // 16), transfer.attributes  # every prompt block went to D
    assert transfer.attributes["pdserve.transfer.bytes"] > 0
    assert transfer.attributes["pdserve.transfer.connector"] == "tcp"
    assert transfer.attributes["pdserve.transfer.gib_per_s"] > 0

    decode = _one(spans, "decode")
    assert decode.service == "pdserve-decode"
    assert decode.attributes["pdserve.completion_tokens"] == usage["completion_tokens"]
    assert decode.attributes["pdserve.preemptions"] == 0
    assert _one(spans, "decode.first_token").parent_span_id == decode.span_id
    for span in spans:
        assert span.start_ns <= span.end_ns, span

    timing = [line for line in live.log("router").splitlines() if " timing: " in line]
    assert len(timing) == 1, timing
    for stage in ("admission_wait=", "routing=", "prefill_compute=", "transfer=", "first_token=", "total="):
        assert stage in timing[0], timing[0]
