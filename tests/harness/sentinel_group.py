"""A real Redis Sentinel group for failover tests: a primary and one replica (redis-server,
cli/redis_launch.py) and three `redis-server --sentinel` processes watching them, all on loopback, quick to
notice a failure (down-after 1 s, failover timeout 3 s); and a cluster of nodes and a router that reach the
index through it.

Owns only what it starts: the servers go into the Cluster's `redis` list and the sentinels are spawned by
the Cluster (their own process groups), so `LiveCluster.stop()` ends them all by pid and asserts none is
left. Each sentinel's config is a file in the cluster's work directory (a sentinel rewrites its own).
"""

from __future__ import annotations

import os
import shutil
import time

import redis
from pdserve.cli.redis_launch import LocalRedis, free_port
from pdserve.cli.up import Cluster
from pdserve.tests.harness.cluster_fixture import (
    LiveCluster,
    NodeProc,
    node_argv,
    router_argv,
    stopped_on_failure,
)

SERVICE = "mymaster"
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 3000


def start_group(cluster: Cluster) -> str:
    """Primary, replica and three sentinels; returns the group's `redis+sentinel://` URL once the sentinels
    know the primary and its replica."""
    binary = shutil.which("redis-server") or LocalRedis.binary
    primary = LocalRedis(binary=binary).start()
    cluster.redis.append(primary)
    replica = LocalRedis(binary=binary, extra_args=("--replicaof", "127.0.0.1", str(primary.port))).start()
    cluster.redis.append(replica)
    ports = [free_port() for _ in range(3)]
    for i, port in enumerate(ports):
        conf = os.path.join(cluster.workdir, f"sentinel-{i}.conf")
        with open(conf, "w", encoding="utf-8") as f:
            f.write(
                f"port {port}\nbind 127.0.0.1\ndir {cluster.workdir}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {primary.port} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
        cluster.spawn(f"sentinel-{i}", [binary, conf, "--sentinel"])
    url = "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in ports) + f"/{SERVICE}"
    deadline = time.monotonic() + 30
    while not all(_knows_replica(port) for port in ports):
        assert time.monotonic() < deadline, "the sentinels did not see the primary and its replica in 30 s"
        time.sleep(0.1)
    return url


def _knows_replica(port: int) -> bool:
    try:
        with redis.Redis(port=port, socket_timeout=1) as client:
            return bool(client.sentinel_slaves(SERVICE)) and len(client.sentinel_sentinels(SERVICE)) >= 2
    except redis.RedisError:
        return False


def primary_port(url: str) -> int | None:
    """The port the first sentinel that answers names as the primary (None: none answers)."""
    for item in url.split("://", 1)[1].split("/", 1)[0].split(","):
        try:
            with redis.Redis(port=int(item.rsplit(":", 1)[1]), socket_timeout=1) as client:
                _, port = client.sentinel_get_master_addr_by_name(SERVICE)
                return int(port)
        except (redis.RedisError, TypeError):
            continue
    return None


def redis_client(url: str) -> redis.Redis:
    """A client of the group's current primary (the sentinels of `url`, a redis+sentinel:// URL)."""
    hosts = url.split("://", 1)[1].split("/", 1)[0].split(",")
    group = redis.Sentinel([(h.rsplit(":", 1)[0], int(h.rsplit(":", 1)[1])) for h in hosts], socket_timeout=2)
    return group.master_for(SERVICE, socket_timeout=2)


def start_cluster(router_extra: tuple[str, ...] = (), node_extra: tuple[str, ...] = ()) -> LiveCluster:
    """The group, one prefill and one decode node and a router, all given the group's URL as `--redis`."""
    cluster = Cluster()
    with stopped_on_failure(cluster):
        url = start_group(cluster)
        nodes = {}
        for role in ("prefill", "decode"):
            name, port = f"{role}-0", free_port()
            argv = node_argv(role, name, port, url, cluster.auth_token, *node_extra)
            nodes[name] = f"http://127.0.0.1:{port}"
            cluster.spawn(name, argv, env=cluster.node_env)
        port = free_port()
        cluster.spawn("router", [*router_argv(port, url), *router_extra], env=cluster.secret_env)
        for node_url in nodes.values():
            cluster.wait_http(f"{node_url}/internal/health", timeout_s=300)
        base = f"http://127.0.0.1:{port}"
        cluster.wait_http(f"{base}/health", timeout_s=120)
    live = LiveCluster(cluster, base, url)
    live.nodes.update({name: NodeProc(name, node_url) for name, node_url in nodes.items()})
    return live
