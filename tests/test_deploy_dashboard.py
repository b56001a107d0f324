"""deploy/grafana's dashboard and the HPAs' adapter rules query only series that a running cluster exports.

Starts a real cluster (Redis, router, one prefill and one decode node), serves a few requests so that the
labelled series exist, reads every /metrics, and compares: each metric name in a panel's or an adapter
rule's PromQL is on some process's /metrics, and each label a query groups or filters by is on that
metric's samples (or is a label Prometheus adds to every target).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml
from pdserve.launch import demo_request
from pdserve.tests.cluster_fixture import LiveCluster, served_model_name, up_config

pytestmark = pytest.mark.slow

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
DASHBOARD = DEPLOY / "grafana" / "pdserve.json"
ADAPTER = DEPLOY / "k8s" / "prometheus-adapter-values.yaml"
TARGET_LABELS = {"namespace", "pod", "service", "le"}
"""Labels Prometheus (through the ServiceMonitor) adds to every series, and the histogram bucket label."""
PROMQL_WORDS = {"by", "without", "sum", "max", "min", "rate", "histogram_quantile", "on", "ignoring"}
PANELS = {
    "Time to first token",
    "Inter-token latency",
    "End-to-end latency",
    "Requests",
    "Tokens",
    "KV use per node",
    "Prefix hits by kind",
    "Transfer bandwidth per connector",
    "Transfers by outcome",
    "Routing decisions",
    "Engine queues per node",
    "Admission refusals",
}
"""The issue's list: TTFT, ITL, E2E percentiles; request and token throughput; KV use per node; prefix
hits by kind; transfer bandwidth and failures per connector; routing decisions; queue depths; refusals."""


@dataclass
class Exposed:
    """What the processes' /metrics showed: every sample or family name, with the label names seen on its
    samples, and which names had at least one sample."""

    labels: dict[str, set[str]] = field(default_factory=dict)
    sampled: set[str] = field(default_factory=set)


def dashboard_queries() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def adapter_queries() -> list[str]:
    rules = yaml.safe_load(ADAPTER.read_text())["rules"]["custom"]
    return [q for r in rules for q in (r["seriesQuery"], r["metricsQuery"])]


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bpdserve_[a-z0-9_]+\b", expr))


def label_names(expr: str) -> set[str]:
    """Labels a query groups by (`by (a, b)`) or matches on (`{a="x", b=~"y"}`)."""
    names = set()
    for group in re.findall(r"\bby \(([^)]*)\)", expr):
        names |= {n.strip() for n in group.split(",") if n.strip()}
    for matchers in re.findall(r"\{([^}]*)\}", expr):
        names |= set(re.findall(r"([a-z_]+)\s*[!=]~?", matchers))
    return {n for n in names - PROMQL_WORDS if not n.startswith("<<")}  # <<.GroupBy>>: the adapter's template


def parse_exposition(text: str, into: Exposed) -> None:
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            into.labels.setdefault(name, set())
            if kind == "histogram":
                for suffix in ("_bucket", "_sum", "_count"):
                    into.labels.setdefault(name + suffix, set())
        elif line and not line.startswith("#"):
            name, _, rest = line.partition("{")
            name = name.split()[0]
            labels = set(re.findall(r'([a-zA-Z_]\w*)="', rest.rpartition("}")[0])) if rest else set()
            into.labels.setdefault(name, set()).update(labels)
            into.sampled.add(name)


@pytest.fixture(scope="module")
def exposed() -> Iterator[Exposed]:
    live = LiveCluster.start(up_config())
    try:
        assert "Paris" in demo_request(live.base)
        body = {
            "model": served_model_name(),
            "prompt": "one two three " * 20,
            "max_tokens": 8,
            "temperature": 0,
        }
        assert httpx.post(f"{live.base}/v1/completions", json=body, timeout=120).status_code == 200
        live.wait_clean()
        seen = Exposed()
        for url in [live.base, *(n.url for n in live.nodes.values())]:
            parse_exposition(httpx.get(f"{url}/metrics", timeout=10).text, seen)
        yield seen
    finally:
        live.stop()


def test_dashboard_has_the_issues_panels() -> None:
    dash = json.loads(DASHBOARD.read_text())
    titles = {p["title"] for p in dash["panels"] if p["type"] != "row"}
    assert titles >= PANELS, f"missing panels: {sorted(PANELS - titles)}"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        for t in p.get("targets", []):
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            assert t["expr"].count("{") == t["expr"].count("}"), t["expr"]


@pytest.mark.parametrize("source", ["dashboard", "adapter"])
def test_every_queried_series_exists_on_a_running_cluster(exposed: Exposed, source: str) -> None:
    queries = dashboard_queries() if source == "dashboard" else adapter_queries()
    assert queries
    missing = sorted({m for q in queries for m in metric_names(q)} - set(exposed.labels))
    assert not missing, f"{source} queries series no process exports: {missing}"


def test_every_queried_label_exists_on_its_series(exposed: Exposed) -> None:
    for expr in dashboard_queries() + adapter_queries():
        metrics = metric_names(expr)
        if not metrics <= exposed.sampled:
            continue  # a family without samples yet (a failure counter): its labels cannot be seen
        labels_seen = set().union(*(exposed.labels[m] for m in metrics))
        unknown = label_names(expr) - TARGET_LABELS - labels_seen
        assert not unknown, f"{expr}: labels {sorted(unknown)} are on none of {sorted(metrics)}"
