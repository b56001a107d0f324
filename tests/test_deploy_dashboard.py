"""The manifests' settings start a working cluster, and the Grafana dashboard and the HPAs' adapter rules
query only series that it exports.

Starts a real cluster as the cpu-demo overlay with the redis-tls component configures its pods (Redis with
AUTH over TLS, router, one prefill and one decode node, every setting from the rendered ConfigMaps and
every secret from a file), checks that no secret is on a command line, serves a few requests so that the
labelled series exist, reads every /metrics, and compares: each metric name in a panel's or an adapter
rule's PromQL is on some process's /metrics, and each label a query groups or filters by is on that
metric's samples (or is a label Prometheus adds to every target).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx2
import pytest
import yaml
from pdserve.cli.redis_launch import LocalRedis, free_port
from pdserve.cli.up import Cluster
from pdserve.tests.harness.cluster_fixture import LiveCluster, NodeProc, model_path, served_model_name
from pdserve.tests.harness.manifests import objs, pod_spec

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


RENDER = "cpu-demo+redis-tls"
SECRETS_DIR = "/var/run/secrets/pdserve/"
REDIS_CA = "/var/run/secrets/pdserve-redis-tls/ca.crt"
IN_CLUSTER_REDIS = "pdserve-redis:6379"


def pod_settings(secrets_dir: str) -> dict[str, dict[str, str]]:
    """Each component's PDSERVE_* variables as the rendered overlay gives its pod: the ConfigMap behind
    envFrom, then the container's own env (values only; the downward-API ones are set per process)."""
    config_maps = objs(RENDER, "ConfigMap")
    settings = {}
    for d in objs(RENDER, "Deployment").values():
        c = pod_spec(d)["containers"][0]
        env: dict[str, str] = {}
        for ref in c["envFrom"]:
            env |= config_maps[ref["configMapRef"]["name"]]["data"]
        env |= {e["name"]: e["value"] for e in c["env"] if "value" in e}
        settings[c["args"][0]] = {k: v.replace(SECRETS_DIR, secrets_dir) for k, v in env.items()}
    return settings


def _tls_cert(workdir: str) -> tuple[str, str]:
    cert, key = os.path.join(workdir, "redis.crt"), os.path.join(workdir, "redis.key")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def start_from_manifests(cluster: Cluster) -> tuple[LiveCluster, str]:
    """Redis with AUTH over TLS, P, D and the router, each started as its pod starts it (`pdserve
    <component>`, no flag), with the overlay's settings; only what is per-pod or per-machine is changed:
    addresses and ports, the model's path, threads, and where the secret files and the CA are."""
    secrets_dir = os.path.join(cluster.workdir, "secrets") + "/"
    os.makedirs(secrets_dir, mode=0o700)
    values = {"auth-token": secrets.token_hex(16), "redis-password": secrets.token_hex(16)}
    values["api-keys"] = secrets.token_hex(16)
    for key, value in values.items():
        with open(os.open(secrets_dir + key, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(value + "\n")
    cert, key = _tls_cert(cluster.workdir)
    redis = LocalRedis(password=values["redis-password"], tls_cert_file=cert, tls_key_file=key)
    cluster.redis.append(redis.start())
    settings = pod_settings(secrets_dir)
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    nodes = {}

    def spawn(command: str, name: str, port: int, extra: dict[str, str]) -> None:
        env = base_env | settings[command] | {"PDSERVE_HOST": "127.0.0.1", "PDSERVE_PORT": str(port)}
        env["PDSERVE_MODEL"] = model_path()
        redis_url = env["PDSERVE_REDIS"].replace(IN_CLUSTER_REDIS, f"127.0.0.1:{redis.port}")
        env["PDSERVE_REDIS"] = redis_url.replace(REDIS_CA, cert)
        cluster.spawn(name, [sys.executable, "-m", "pdserve.cli", command], env | extra)

    for command in ("prefill", "decode"):
        name, port = f"{command}-0", free_port()
        spawn(command, name, port, {"PDSERVE_NODE_ID": name, "PDSERVE_THREADS": "1",
                                    "PDSERVE_TRANSFER_PORT": str(free_port())})  # fmt: skip
        nodes[name] = NodeProc(name, f"http://127.0.0.1:{port}")
    for node in nodes.values():
        cluster.wait_http(f"{node.url}/internal/health", timeout_s=300)
    port = free_port()
    spawn("router", "router", port, {})
    base = f"http://127.0.0.1:{port}"
    cluster.wait_http(f"{base}/health", timeout_s=120)
    listing = subprocess.run(["ps", "-eo", "pid,args", "--no-headers", "-ww"], capture_output=True, text=True,
                             check=True).stdout.splitlines()  # fmt: skip
    pids = {str(redis.pid), *(str(proc.pid) for _, proc in cluster.procs)}
    assert pids <= {line.split()[0] for line in listing}, "ps lists every process of the cluster"
    for line in listing:  # redis-server, the nodes and the router included: no secret on any command line
        assert not any(v in line for v in values.values()), f"a secret is on a command line: {line}"
    return LiveCluster(cluster, base, redis.url, nodes, values["auth-token"]), values["api-keys"]


@pytest.fixture(scope="module")
def exposed() -> Iterator[Exposed]:
    cluster = Cluster()
    try:
        live, api_key = start_from_manifests(cluster)
    except BaseException:
        cluster.stop()
        raise
    try:
        headers = {"Authorization": f"Bearer {api_key}"}
        chat = {
            "model": served_model_name(),
            "max_tokens": 24,
            "temperature": 0,
            "messages": [{"role": "user", "content": "In one sentence, what is the capital of France?"}],
        }
        reply = httpx2.post(f"{live.base}/v1/chat/completions", json=chat, headers=headers, timeout=120)
        assert reply.status_code == 200, reply.text
        assert "Paris" in reply.json()["choices"][0]["message"]["content"]
        body = {
            "model": served_model_name(),
            "prompt": "one two three " * 20,
            "max_tokens": 8,
            "temperature": 0,
        }
        reply = httpx2.post(f"{live.base}/v1/completions", json=body, headers=headers, timeout=120)
        assert reply.status_code == 200, reply.text
        assert httpx2.post(f"{live.base}/v1/completions", json=body, timeout=30).status_code == 401
        live.wait_clean()
        seen = Exposed()
        for url in [live.base, *(n.url for n in live.nodes.values())]:
            parse_exposition(httpx2.get(f"{url}/metrics", headers=headers, timeout=10).text, seen)
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
