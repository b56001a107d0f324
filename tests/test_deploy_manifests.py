"""deploy/: every kustomization renders with kustomize and validates against the Kubernetes API schemas of a
current release; what the manifests promise holds in the rendered objects (each pool scaled on its own
signal, probes and drain, secrets only from files, NetworkPolicy peers, GPU placement, settings the CLIs
accept); the Dockerfiles pass hadolint.

Offline and fast: kubectl (kustomize), the schemas and hadolint come as wheels of the `test` extra.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from pdserve.shared.index.redis_url import parse_sentinel
from pdserve.tests.harness.manifests import DEPLOY, K8S, Obj, objs, pod_spec, render

KUBE_VERSION = "1.37.0"
"""The newest Kubernetes release whose API schemas kubernetes-validate ships."""
RENDERS = (
    "base",
    "overlays/cpu-demo",
    "overlays/gpu",
    "overlays/gpu-tp2",
    "overlays/cpu-demo-sentinel",
    "overlays/cpu-demo-planner",
    "cpu-demo+redis-tls",
    "cpu-demo+redis-no-aof",
)
CRD_KINDS = {"ServiceMonitor"}
"""prometheus-operator's kinds: no schema ships offline; test_service_monitor_selects_every_component
checks them."""
SECRET_KEYS = {"auth-token", "api-keys", "redis-password"}
COMPONENTS = {"router", "prefill", "decode"}
COMMANDS = {"router": "router", "prefill": "prefill", "decode": "decode", "planner": "plan"}
"""The `pdserve` command each component's pods run."""


def components(name: str) -> set[str]:
    """The components an overlay runs: the serving ones, and the planner in the planner overlay."""
    return COMPONENTS | ({"planner"} if name.endswith("-planner") else set())


def component(workload: Obj) -> str:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels["app.kubernetes.io/component"]


def workloads(name: str) -> Iterator[Obj]:
    for o in render(name):
        if o["kind"] in ("Deployment", "StatefulSet"):
            yield o


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", expr
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


@pytest.mark.parametrize("name", RENDERS)
def test_renders_and_validates_against_kubernetes_schemas(name: str) -> None:
    rendered = render(name)
    kinds = {o["kind"] for o in rendered}
    for kind in ("StatefulSet", "Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget",
                 "NetworkPolicy", "ConfigMap", "ServiceMonitor"):  # fmt: skip
        assert kind in kinds, f"{name}: no {kind} rendered"
    for o in rendered:
        if o["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(o, KUBE_VERSION, strict=True)


def test_validator_rejects_a_misspelled_field() -> None:
    """The validation above has teeth: strict mode refuses a field the API does not know."""
    deployment = copy.deepcopy(objs("overlays/cpu-demo", "Deployment")["pdserve-decode"])
    container = pod_spec(deployment)["containers"][0]
    container["readinesProbes"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("name", RENDERS)
def test_references_resolve(name: str) -> None:
    """ConfigMaps, Secrets keys, Services, HPA and PDB targets all point at something that exists."""
    config_maps = objs(name, "ConfigMap")
    pods = {o["metadata"]["name"]: o["spec"]["template"]["metadata"]["labels"] for o in workloads(name)}
    deployments = objs(name, "Deployment")
    for w in workloads(name):
        assert selects(w["spec"]["selector"], pods[w["metadata"]["name"]])
        spec = pod_spec(w)
        for c in spec.get("initContainers", []) + spec["containers"]:
            for ref in c.get("envFrom", []):
                assert ref["configMapRef"]["name"] in config_maps, (w["metadata"]["name"], ref)
        for v in spec["volumes"]:
            if "configMap" in v:
                assert v["configMap"]["name"] in config_maps, (w["metadata"]["name"], v)
            if "secret" in v and v["secret"]["secretName"] == "pdserve-secrets":
                assert {i["key"] for i in v["secret"]["items"]} <= SECRET_KEYS
    for svc in objs(name, "Service").values():
        assert any(selects({"matchLabels": svc["spec"]["selector"]}, p) for p in pods.values()), svc
    for hpa in objs(name, "HorizontalPodAutoscaler").values():
        assert hpa["spec"]["scaleTargetRef"]["name"] in deployments
    for pdb in objs(name, "PodDisruptionBudget").values():
        assert any(selects(pdb["spec"]["selector"], p) for p in pods.values()), pdb


def _help_env_names(command: str) -> set[str]:
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", command, "--help"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return set(re.findall(r"PDSERVE_[A-Z0-9_]+[A-Z0-9]", done.stdout))


@functools.cache
def accepted_env(command: str) -> frozenset[str]:
    """The PDSERVE_* variables `pdserve <command>` reads, as its --help lists them."""
    return frozenset(_help_env_names(command))


@pytest.mark.parametrize("name", RENDERS)
def test_settings_are_ones_the_cli_accepts(name: str) -> None:
    """Every PDSERVE_* variable a pod gets (env and its ConfigMaps) is a setting of its component."""
    config_maps = objs(name, "ConfigMap")
    for w in workloads(name):
        for c in pod_spec(w)["containers"]:
            if c.get("image", "").startswith("redis"):
                continue
            command = c["args"][0]
            assert command == COMMANDS[component(w)], c["args"]
            names = {e["name"] for e in c.get("env", [])}
            for ref in c.get("envFrom", []):
                names |= set(config_maps[ref["configMapRef"]["name"]]["data"])
            unknown = {n for n in names if n.startswith("PDSERVE_")} - accepted_env(command)
            assert not unknown, f"{name}: pdserve {command} reads no {sorted(unknown)}"


@pytest.mark.parametrize("name", RENDERS)
def test_secrets_only_from_files(name: str) -> None:
    """No Secret object is committed, no secret flag or value is on a command line, secrets are *_FILE."""
    assert not [o for o in render(name) if o["kind"] == "Secret"]
    for w in workloads(name):
        spec = pod_spec(w)
        for c in spec.get("initContainers", []) + spec["containers"]:
            argv = " ".join(c.get("command", []) + c.get("args", []))
            assert not re.search(r"--(auth-token|api-key|redis-password|requirepass)\b", argv), argv
            for e in c.get("env", []):
                if re.search(r"TOKEN|KEYS|PASSWORD", e["name"]):
                    assert e["name"].endswith("_FILE") and e["value"].startswith("/var/run/secrets/"), e


@pytest.mark.parametrize("name", RENDERS)
def test_pods_run_locked_down(name: str) -> None:
    for w in workloads(name):
        spec = pod_spec(w)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["enableServiceLinks"] is False, "Service variables would land in the PDSERVE_ namespace"
        assert spec["automountServiceAccountToken"] is False
        for c in spec.get("initContainers", []) + spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
            assert sc["readOnlyRootFilesystem"] is True


@pytest.mark.parametrize("name", ("overlays/cpu-demo", "overlays/gpu"))
def test_pools_scale_separately_on_their_own_signals(name: str) -> None:
    hpas = objs(name, "HorizontalPodAutoscaler")
    deployments = objs(name, "Deployment")
    assert {component(d) for d in deployments.values()} == COMPONENTS
    targets = {h["spec"]["scaleTargetRef"]["name"]: h for h in hpas.values()}
    assert set(targets) == set(deployments), "each pool has its own HPA"
    signals = {
        component(deployments[t]): {m["pods"]["metric"]["name"] for m in h["spec"]["metrics"] if "pods" in m}
        for t, h in targets.items()
    }
    assert signals["prefill"] == {"pdserve_prefill_queued_prefill_tokens"}
    assert signals["decode"] == {"pdserve_decode_kv_usage_ratio", "pdserve_decode_running_requests"}
    values = yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())
    served = {rule["name"]["as"] for rule in values["rules"]["custom"]}
    assert signals["prefill"] | signals["decode"] <= served, "prometheus-adapter must serve every HPA metric"


def test_planner_overlay_scales_each_pool_to_the_planners_count() -> None:
    name = "overlays/cpu-demo-planner"
    (planner,) = (w for w in workloads(name) if component(w) == "planner")
    c = pod_spec(planner)["containers"][0]
    settings = objs(name, "ConfigMap")[c["envFrom"][0]["configMapRef"]["name"]]["data"]
    assert c["args"] == ["plan"] and "PDSERVE_APPLY" not in settings, (
        "in Kubernetes the HPAs act, not --apply"
    )
    port = int(settings["PDSERVE_METRICS_PORT"])
    assert float(settings["PDSERVE_WATCH"]) > 0 and c["ports"][0]["containerPort"] == port
    deployments = objs(name, "Deployment")
    for hpa in objs(name, "HorizontalPodAutoscaler").values():
        role = component(deployments[hpa["spec"]["scaleTargetRef"]["name"]])
        if role == "router":
            continue
        (metric,) = hpa["spec"]["metrics"]
        assert metric["external"]["metric"] == {"name": "pdserve_desired_nodes",
                                                "selector": {"matchLabels": {"role": role}}}  # fmt: skip
        assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    values = yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())
    assert {r["name"]["as"] for r in values["rules"]["external"]} == {"pdserve_desired_nodes"}
    policies = objs(name, "NetworkPolicy")
    for policy in ("pdserve-nodes", "pdserve-redis"):
        peers = policies[policy]["spec"]["ingress"][0]["from"]
        assert {"podSelector": {"matchLabels": {"app.kubernetes.io/component": "planner"}}} in peers


@pytest.mark.parametrize("name", ("overlays/cpu-demo", "overlays/gpu"))
def test_probes_and_drain_before_stop(name: str) -> None:
    for d in objs(name, "Deployment").values():
        spec = pod_spec(d)
        c = spec["containers"][0]
        if component(d) == "router":
            assert c["readinessProbe"]["httpGet"]["path"] == "/health"
            assert "tcpSocket" in c["livenessProbe"], "an empty pool must not restart routers"
            continue
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/internal/health", "port": "http"}, (d, probe)
        hook = c["lifecycle"]["preStop"]["exec"]["command"]
        assert hook[:2] == ["pdserve-probe", "drain"]
        drain_s = float(hook[hook.index("--timeout") + 1])
        assert drain_s + 10 <= spec["terminationGracePeriodSeconds"], "SIGKILL would cut the drain short"
        env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in c["env"]}
        assert env["PDSERVE_HOST"] == "status.podIP" and env["PDSERVE_NODE_ID"] == "metadata.name"


def _peers(rule: Obj) -> list[Obj]:
    return list(rule["from"])


@pytest.mark.parametrize("name", ("overlays/cpu-demo", "overlays/gpu"))
def test_only_router_and_peers_reach_node_ports(name: str) -> None:
    policy = objs(name, "NetworkPolicy")["pdserve-nodes"]
    assert policy["spec"]["podSelector"] == {"matchLabels": {"pdserve.dev/node": "true"}}
    node = {"pdserve.dev/node": "true"}
    router = {"app.kubernetes.io/component": "router"}
    reach: dict[str, set[int | None]] = {}
    for rule in policy["spec"]["ingress"]:
        ports = {p["port"] for p in rule["ports"]} if "ports" in rule else {None}  # None: every port
        for peer in _peers(rule):
            labels = peer["podSelector"]["matchLabels"]
            key = "router" if labels == router else "node" if labels == node else "other"
            if "namespaceSelector" in peer:
                key = "monitoring"
            reach.setdefault(key, set()).update(ports)
    assert reach["router"] == {8100}
    assert reach["monitoring"] == {8100}, "Prometheus scrapes /metrics, never the transfer port"
    assert reach["node"] == ({None} if name.endswith("gpu") else {8100, 8200})
    assert "other" not in reach
    for d in objs(name, "Deployment").values():
        if component(d) in ("prefill", "decode"):
            assert d["spec"]["template"]["metadata"]["labels"]["pdserve.dev/node"] == "true"


def test_gpu_overlay_places_nodes_on_gpus_and_configures_the_connector() -> None:
    deployments = objs("overlays/gpu", "Deployment")
    config_maps = objs("overlays/gpu", "ConfigMap")
    connectors = set()
    for d in deployments.values():
        spec = pod_spec(d)
        limits = spec["containers"][0]["resources"].get("limits", {})
        if component(d) == "router":
            assert "nvidia.com/gpu" not in limits and "nodeSelector" not in spec
            continue
        assert limits["nvidia.com/gpu"] == "1"
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        (ref,) = spec["containers"][0]["envFrom"]
        data = config_maps[ref["configMapRef"]["name"]]["data"]
        assert data["PDSERVE_DEVICE"] == "cuda"
        connectors.add(data["PDSERVE_CONNECTOR"])
    assert len(connectors) == 1 and connectors <= {"tcp", "ucx", "nccl"}, "P and D share one connector"
    assert "pdserve-models" in objs("overlays/gpu", "PersistentVolumeClaim")


def test_gpu_tp2_overlay_gives_decode_pods_two_gpus_and_two_ranks() -> None:
    deployments = objs("overlays/gpu-tp2", "Deployment")
    config_maps = objs("overlays/gpu-tp2", "ConfigMap")
    for role, gpus, ranks in (("prefill", "1", None), ("decode", "2", "2")):
        container = pod_spec(deployments[f"pdserve-{role}"])["containers"][0]
        resources = container["resources"]
        assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == gpus
        (ref,) = container["envFrom"]
        data = config_maps[ref["configMapRef"]["name"]]["data"]
        assert data.get("PDSERVE_TENSOR_PARALLEL_SIZE") == ranks and data["PDSERVE_DEVICE"] == "cuda"


def test_redis_asks_for_auth_and_tls_is_an_option() -> None:
    plain = objs("overlays/cpu-demo", "ConfigMap")
    tls = objs("cpu-demo+redis-tls", "ConfigMap")
    (conf,) = [c["data"]["redis.conf"] for n, c in plain.items() if n.startswith("pdserve-redis")]
    (tls_conf,) = [c["data"]["redis.conf"] for n, c in tls.items() if n.startswith("pdserve-redis")]
    assert "include /run/redis/auth.conf" in conf and "requirepass" not in conf
    assert "port 0" in tls_conf and "tls-port 6379" in tls_conf
    urls = {c["data"]["PDSERVE_REDIS"] for c in tls.values() if "PDSERVE_REDIS" in c.get("data", {})}
    assert urls and all(u.startswith("rediss://") and "ssl_ca_certs=" in u for u in urls)


def _redis_conf(name: str) -> dict[str, str]:
    (data,) = [c["data"] for n, c in objs(name, "ConfigMap").items() if n.startswith("pdserve-redis")]
    return dict(data)


@pytest.mark.parametrize("name", ["overlays/cpu-demo", "overlays/gpu", "cpu-demo+redis-tls"])
def test_redis_keeps_an_append_only_file(name: str) -> None:
    """AOF is on in every manifest (issue 20): redis.conf includes persistence.conf, which turns it on in the
    pod's data volume; the StatefulSet mounts that volume where the file points."""
    conf = _redis_conf(name)
    assert "include /etc/redis/persistence.conf" in conf["redis.conf"]
    assert "appendonly no" not in conf["redis.conf"]
    persistence = conf["persistence.conf"].splitlines()
    assert (
        "appendonly yes" in persistence
        and "appendfsync everysec" in persistence
        and "dir /data" in persistence
    )
    (redis,) = objs(name, "StatefulSet").values()
    mounts = {m["mountPath"] for m in pod_spec(redis)["containers"][0]["volumeMounts"]}
    assert "/data" in mounts


def test_the_sentinel_overlay_runs_a_replica_three_sentinels_and_points_every_client_at_them() -> None:
    name = "overlays/cpu-demo-sentinel"
    sets = objs(name, "StatefulSet")
    assert [sets[n]["spec"]["replicas"] for n in ("pdserve-redis", "pdserve-sentinel")] == [2, 3]
    config_maps = objs(name, "ConfigMap")
    redis_conf = next(c for n, c in config_maps.items() if n.startswith("pdserve-redis"))
    assert {"redis-start.sh", "redis.conf"} <= set(redis_conf["data"])
    sentinels = {f"pdserve-sentinel-{i}.pdserve-sentinel" for i in range(3)}
    for w in workloads(name):
        if component(w) not in COMPONENTS:
            continue
        (ref,) = pod_spec(w)["containers"][0]["envFrom"]
        target = parse_sentinel(config_maps[ref["configMapRef"]["name"]]["data"]["PDSERVE_REDIS"])
        assert target.service == "mymaster" and {h for h, _ in target.sentinels} == sentinels
    policy = objs(name, "NetworkPolicy")["pdserve-sentinel"]
    peers = [p["podSelector"]["matchLabels"] for rule in policy["spec"]["ingress"] for p in rule["from"]]
    assert {"app.kubernetes.io/component": "router"} in peers and {"pdserve.dev/node": "true"} in peers
    assert objs(name, "PodDisruptionBudget")["pdserve-sentinel"]["spec"]["minAvailable"] == 2


def test_redis_aof_is_an_option() -> None:
    conf = _redis_conf("cpu-demo+redis-no-aof")
    assert "include /etc/redis/persistence.conf" in conf["redis.conf"]
    assert "appendonly no" in conf["persistence.conf"].splitlines()


@pytest.mark.parametrize("name", RENDERS)
def test_service_monitor_selects_every_component(name: str) -> None:
    (monitor,) = objs(name, "ServiceMonitor").values()
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    ports = {e["port"] for e in monitor["spec"]["endpoints"]}
    seen = set()
    for svc in objs(name, "Service").values():
        if selects(monitor["spec"]["selector"], svc["metadata"]["labels"]):
            assert ports <= {p["name"] for p in svc["spec"]["ports"]}, svc["metadata"]["name"]
            seen.add(svc["metadata"]["labels"]["app.kubernetes.io/component"])
    assert seen == components(name)
    dashboards = [c for c in objs(name, "ConfigMap").values() if "pdserve.json" in c.get("data", {})]
    assert len(dashboards) == 1 and dashboards[0]["metadata"]["labels"]["grafana_dashboard"] == "1"


DOCKERFILES = sorted((DEPLOY / "docker").glob("*.Dockerfile"))


def test_dockerfiles_pass_hadolint() -> None:
    hadolint = os.path.join(sysconfig.get_path("scripts"), "hadolint")
    assert len(DOCKERFILES) == 2
    done = subprocess.run([hadolint, *map(str, DOCKERFILES)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_is_multi_stage_non_root_and_model_free(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    assert len(re.findall(r"^FROM ", text, re.M)) >= 2, "multi-stage"
    (user,) = re.findall(r"^USER (\S+)", text, re.M)
    assert not user.startswith(("0", "root"))
    assert re.search(r"^HEALTHCHECK .*pdserve-probe", text, re.M)
    assert re.search(r'^ENTRYPOINT \["pdserve"\]', text, re.M)
    ignore = Path(f"{dockerfile}.dockerignore").read_text().split()
    assert {"**/*.gguf", "**/*.safetensors", ".git"} <= set(ignore), "weights never enter the build context"
