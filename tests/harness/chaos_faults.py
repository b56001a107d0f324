"""Faults for the chaos tests, done to a LiveCluster's real processes: kill -9 of a node, of Redis or of the
router, and starting each again where it was (same port, same id), so the cluster's own cleanup stops it;
and how the index is checked after one (`kvctl diff` until clean).

Owns nothing beyond the LiveCluster it is given: a killed process is reaped here, a restarted one is
registered with the cluster (`Cluster.spawn`, `Cluster.redis`), and `LiveCluster.nodes` always lists the
nodes that should be running (so `wait_clean` audits only survivors).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx2
from pdserve.cli.up import start_redis
from pdserve.tests.harness.cluster_fixture import (
    LiveCluster,
    NodeProc,
    kvctl_main,
    node_argv,
    router_argv,
    up_config,
)

SMALL_KV = ("--kv-cache-gib", "0.125")
"""182 blocks of 16 tokens: plenty for 16 short streams, and 0.9 GiB less memory per node."""


@contextlib.contextmanager
def small_cluster(prefill: int, decode: int, router_args: tuple[str, ...] = ()) -> Iterator[LiveCluster]:
    """A started cluster of small-KV nodes (SMALL_KV), stopped (and checked gone) on exit."""
    cfg = up_config(prefill=prefill, decode=decode, extra_node_args=SMALL_KV, router_args=router_args)
    cluster = LiveCluster.start(cfg)
    try:
        yield cluster
    finally:
        cluster.stop()


def reference(
    live: LiveCluster, model: str, prompts: list[str], max_tokens: int, sampling: dict[str, Any] | None = None
) -> dict[str, str]:
    """Each prompt's text through the undisturbed cluster (greedy, or the given seeded sampling)."""
    out = {}
    for prompt in prompts:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            **(sampling or {"temperature": 0}),
        }
        r = httpx2.post(f"{live.base}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out[prompt] = r.json()["choices"][0]["text"]
    return out


def _proc(live: LiveCluster, name: str) -> subprocess.Popen[bytes]:
    return next(p for n, p in reversed(live.cluster.procs) if n == name)


def kill9(live: LiveCluster, name: str) -> str:
    """kill -9 of a node or the router (its whole process group); returns the URL it served."""
    proc = _proc(live, name)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
    live.cluster.procs.remove((name, proc))  # reaped: the cluster's liveness checks skip it from now on
    if name == "router":
        return live.base
    return live.nodes.pop(name).url


def restart_node(live: LiveCluster, name: str, url: str, *extra: str) -> None:
    """Starts node `name` again on its port (its old process is gone) and waits for its health."""
    role = name.split("-")[0]
    port = int(url.rsplit(":", 1)[1])
    argv = node_argv(role, name, port, live.redis_url, live.auth_token, *extra)
    live.cluster.spawn(name, argv, env=live.cluster.secret_env)
    live.cluster.wait_http(f"{url}/internal/health", timeout_s=300)
    live.nodes[name] = NodeProc(name, url)


def start_router(live: LiveCluster, name: str, port: int, *extra: str) -> str:
    """A router process on `port` (the cluster's credential in its environment); returns its base URL once
    /health answers."""
    live.cluster.spawn(name, [*router_argv(port, live.redis_url), *extra], env=live.cluster.secret_env)
    base = f"http://127.0.0.1:{port}"
    live.cluster.wait_http(f"{base}/health", timeout_s=120)
    return base


def kill_redis(live: LiveCluster) -> int:
    """kill -9 of the cluster's redis-server; returns its port."""
    redis = live.cluster.redis.pop(0)
    assert redis.pid is not None
    os.kill(redis.pid, signal.SIGKILL)
    redis.stop()  # reaps it and removes its temporary directory (never an AOF directory)
    live.cluster.redis.insert(0, redis)  # a dead server: stop() again is a no-op
    return redis.port


def restart_redis(live: LiveCluster, port: int, aof_dir: str | None = None) -> float:
    """A redis-server on `port` again (empty, or loading the AOF in aof_dir); returns when it answered."""
    dead = live.cluster.redis.pop(0)
    assert not dead.running
    start_redis(live.cluster, aof_dir=aof_dir, port=port)
    live.cluster.redis.insert(0, live.cluster.redis.pop())
    return time.monotonic()


def index_diff(live: LiveCluster) -> dict[str, object] | None:
    """kvctl diff's rows of the surviving nodes; None when every one is listed, answers and agrees."""
    try:
        rows = kvctl_main(live.redis_url, "diff", "--timeout", "60")["nodes"]
    except AssertionError as exc:  # Redis unreachable: kvctl exits 1
        return {"kvctl": str(exc)}
    survivors = {n: rows.get(n) for n in live.nodes}
    ok = all(
        r is not None and "error" not in r and r["extra"] == r["missing"] == 0 for r in survivors.values()
    )
    return None if ok else survivors


def wait_index_clean(live: LiveCluster, since: float, budget_s: float) -> float:
    """Seconds from `since` to the start of the first kvctl diff that came back clean; asserts one that
    started within budget_s did. (A node answers between engine steps: on the 2-core CPU a step of long
    prefills takes seconds, so an answer may come later than the question.)"""
    while True:
        asked = time.monotonic()
        diff = index_diff(live)
        if diff is None:
            return asked - since
        assert asked - since < budget_s, f"kvctl diff not clean {budget_s:.1f} s after the fault: {diff}"
        time.sleep(0.1)
