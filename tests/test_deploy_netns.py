"""Multi-host without a cluster at hand: Redis, the router, one prefill and one decode node, each in its own
Linux network namespace with its own 10.x address on a veth pair joined by a bridge.

No same-host shortcut can be taken: each process sees only its own loopback, reaches the others through
the bridge by address, and gets a private /dev/shm (a mount namespace with its own tmpfs), so a doorbell
file or a loopback connection between nodes cannot work. The root namespace holds the bridge's address
and plays the operator: `make up`'s demo request, the official openai client and `kvctl` run from there.

Owns: the namespaces, the bridge and the veth pairs it creates (names unique per run), and the processes it
starts inside them; all are removed in `finally`, processes first (by process group), then namespaces.
Needs root (`ip netns add`); skipped with that reason otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
from pdserve.cli.up import Cluster, demo_request
from pdserve.tests.harness import cluster_fixture

pytestmark = pytest.mark.slow

HOSTS = ("redis", "router", "prefill", "decode")
REDIS_PORT, ROUTER_PORT, NODE_PORT, TRANSFER_PORT = 6379, 8000, 8100, 8200
PROMPT = (
    "The history of the printing press begins in the fifteenth century, when movable type made books "
    "cheaper to produce, and it changed how ideas travelled across Europe. In one paragraph, explain why"
)
PRIVATE_SHM = 'mount -t tmpfs -o size=64m,mode=1777 pdserve-netns-shm /dev/shm && exec "$@"'


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")


def _free_subnet() -> str:
    """A 10.a.b.0/24 prefix that no interface or route of this machine uses yet."""
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    used += subprocess.run(["ip", "-4", "route"], capture_output=True, text=True, check=True).stdout
    for _ in range(100):
        prefix = f"10.{200 + secrets.randbelow(55)}.{secrets.randbelow(256)}"
        if f"{prefix}." not in used:
            return prefix
    raise RuntimeError("no free 10.x.y.0/24 subnet found for the test bridge")


@dataclass
class Hosts:
    """One network namespace per component on a bridge in the root namespace (which holds `.1`)."""

    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    prefix: str = field(default_factory=_free_subnet)
    created: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"pdbr{self.tag}"

    def ns(self, host: str) -> str:
        return f"pdserve-{self.tag}-{host}"

    def addr(self, host: str) -> str:
        return f"{self.prefix}.{10 + HOSTS.index(host)}"

    def veth(self, host: str) -> str:
        """The root-namespace end of the host's veth pair (its link to the bridge)."""
        return f"pdv{self.tag}{HOSTS.index(host)}"

    def create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self.created.append(self.bridge)
        # bridged frames between namespaces skip the host's iptables, whatever its FORWARD policy
        with contextlib.suppress(RuntimeError):
            _ip("link", "set", self.bridge, "type", "bridge", "nf_call_iptables", "0")
        _ip("addr", "add", f"{self.prefix}.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for host in HOSTS:
            ns = self.ns(host)
            _ip("netns", "add", ns)
            self.created.append(ns)
            _ip("link", "add", self.veth(host), "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", self.veth(host), "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def destroy(self) -> None:
        """Each veth pair is deleted by its root end first: deleting a namespace would free its links only
        when the kernel's namespace cleanup runs, which took over 10 s on a loaded 2-core CI machine. Then
        the namespaces, the bridge last."""
        for name in reversed(self.created):
            if name != self.bridge:
                with contextlib.suppress(RuntimeError):
                    _ip("link", "del", self.veth(name.removeprefix(f"pdserve-{self.tag}-")))
            with contextlib.suppress(RuntimeError):
                _ip("link", "del", name) if name == self.bridge else _ip("netns", "del", name)
        self.created.clear()

    def argv(self, host: str, *command: str) -> list[str]:
        """`command` run in the host's namespace with a private /dev/shm (same pid: every step execs)."""
        return ["ip", "netns", "exec", self.ns(host), "unshare", "--mount", "--propagation", "private",
                "sh", "-c", PRIVATE_SHM, "sh", *command]  # fmt: skip


def _netns_available() -> str | None:
    probe = f"pdserve-probe-{secrets.token_hex(3)}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return f"`ip netns add` failed ({done.stderr.strip() or 'no ip command'}): needs root"
    subprocess.run(["ip", "netns", "del", probe], check=False)
    return None


@dataclass
class NetCluster:
    hosts: Hosts
    live: cluster_fixture.LiveCluster
    redis_url: str
    redis_password: str
    auth_token: str

    def kvctl(self, *args: str) -> dict[str, Any]:
        """The real `kvctl ... --json`, run from the root namespace; the password through the environment."""
        done = subprocess.run(
            [sys.executable, "-m", "pdserve.kvctl.cli", *args, "--redis", self.redis_url, "--json"],
            capture_output=True, text=True, timeout=120, check=False,
            env=self.secret_env(),
        )  # fmt: skip
        assert done.returncode == 0, f"kvctl {args} exited {done.returncode}: {done.stderr}"
        result: dict[str, Any] = json.loads(done.stdout)
        return result

    def secret_env(self) -> dict[str, str]:
        """The environment an operator's tool gets: the Redis password and the cluster's credential."""
        return {
            **os.environ,
            "PDSERVE_REDIS_PASSWORD": self.redis_password,
            "PDSERVE_AUTH_TOKEN": self.auth_token,
        }


def _wait_redis(url: str, password: str, cluster: Cluster, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    client = redis.Redis.from_url(url, password=password, socket_timeout=1.0)
    try:
        while True:
            cluster.check_alive()
            with contextlib.suppress(redis.RedisError):
                if client.ping():
                    return
            assert time.monotonic() < deadline, f"redis at {url} did not answer within {timeout_s:.0f}s"
            time.sleep(0.2)
    finally:
        client.close()


def _start(hosts: Hosts, cluster: Cluster) -> NetCluster:
    py, model = sys.executable, cluster_fixture.model_path()
    password, token = secrets.token_hex(16), secrets.token_hex(16)
    # secrets through the environment, never argv (they would show in `ps`)
    env = {**os.environ, "PDSERVE_AUTH_TOKEN": token, "PDSERVE_REDIS_PASSWORD": password}
    conf = os.path.join(cluster.workdir, "redis.conf")
    with open(os.open(conf, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(f'bind {hosts.addr("redis")}\nport {REDIS_PORT}\nrequirepass "{password}"\n')
        f.write('save ""\nappendonly no\nprotected-mode no\n' + f"dir {cluster.workdir}\n")
    cluster.spawn("redis", hosts.argv("redis", "redis-server", conf))
    redis_url = f"redis://{hosts.addr('redis')}:{REDIS_PORT}/0"
    _wait_redis(redis_url, password, cluster, 30)
    nodes = {}
    for role in ("prefill", "decode"):
        node_id = f"{role}-0"
        argv = [py, "-m", f"pdserve.{role}_node", "--node-id", node_id, "--host", hosts.addr(role),
                "--port", str(NODE_PORT), "--redis", redis_url, "--model", model,
                "--threads", "1"]  # fmt: skip
        if role == "decode":
            argv += ["--transfer-port", str(TRANSFER_PORT)]
        cluster.spawn(node_id, hosts.argv(role, *argv), env)
        nodes[node_id] = cluster_fixture.NodeProc(node_id, f"http://{hosts.addr(role)}:{NODE_PORT}")
    for node in nodes.values():
        cluster.wait_http(f"{node.url}/internal/health", timeout_s=300)
    router = [py, "-m", "pdserve.router", "--model", model, "--redis", redis_url,
              "--host", hosts.addr("router"), "--port", str(ROUTER_PORT)]  # fmt: skip
    cluster.spawn("router", hosts.argv("router", *router), env)
    base = f"http://{hosts.addr('router')}:{ROUTER_PORT}"
    cluster.wait_http(f"{base}/health", timeout_s=120)
    live = cluster_fixture.LiveCluster(cluster, base, redis_url, nodes, token)
    return NetCluster(hosts, live, redis_url, password, token)


@pytest.fixture(scope="module")
def net() -> Iterator[NetCluster]:
    reason = _netns_available()
    if reason is not None:
        pytest.skip(reason)
    hosts = Hosts()
    cluster = Cluster(workdir=tempfile.mkdtemp(prefix="pdserve-netns-"))
    live: cluster_fixture.LiveCluster | None = None
    try:
        hosts.create()
        started = _start(hosts, cluster)
        live = started.live
        yield started
    finally:
        with contextlib.suppress(RuntimeError):
            _ip("link", "set", hosts.veth("decode"), "up")
        if live is not None:
            live.stop()
        else:
            cluster.stop()
        hosts.destroy()
    _assert_gone(hosts.tag, timeout_s=10)


def _assert_gone(tag: str, timeout_s: float) -> None:
    """No link or namespace named with this run's tag is left (the kernel frees a namespace's links
    shortly after its last process and name are gone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=False).stdout
        spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
        left = [line for line in (links + spaces).splitlines() if tag in line]
        if not left:
            return
        assert time.monotonic() < deadline, f"test namespaces or links left behind: {left}"
        time.sleep(0.2)


def _client(net: NetCluster, timeout_s: float = 120.0) -> openai.OpenAI:
    # trust_env=False: a proxy from the environment must not carry requests meant for the bridge
    http = openai.DefaultHttpxClient(trust_env=False, timeout=timeout_s)
    return openai.OpenAI(base_url=f"{net.live.base}/v1", api_key="unused", http_client=http, max_retries=0)


def test_nodes_register_their_namespace_addresses(net: NetCluster) -> None:
    """kvctl, run from the root namespace, sees both nodes at their own addresses, not at loopback."""
    nodes = {n["info"]["node_id"]: n["info"] for n in net.kvctl("nodes")["nodes"]}
    assert set(nodes) == {"prefill-0", "decode-0"}
    assert nodes["prefill-0"]["http_url"] == f"http://{net.hosts.addr('prefill')}:{NODE_PORT}"
    assert nodes["decode-0"]["http_url"] == f"http://{net.hosts.addr('decode')}:{NODE_PORT}"
    assert nodes["decode-0"]["transfer_addr"] == f"tcp://{net.hosts.addr('decode')}:{TRANSFER_PORT}"


def test_demo_request_from_outside(net: NetCluster) -> None:
    """`make up`'s demo chat request, sent from the root namespace through the bridge."""
    assert "Paris" in demo_request(net.live.base)
    net.live.wait_clean()


def test_openai_client_matches_pdserve_generate(net: NetCluster) -> None:
    """Greedy text through router -> P -> (KV over the bridge) -> D equals the offline engine's."""
    offline = cluster_fixture.generate_offline("--prompt", PROMPT, "--max-tokens", "24")
    assert len(offline["prompt_token_ids"]) > 32, "the prompt must span several KV blocks"
    received = net.live.metric("decode-0", "pdserve_kv_transfer_bytes_total", {"direction": "in"})
    with _client(net) as client:
        out = client.completions.create(
            model=cluster_fixture.served_model_name(), prompt=PROMPT, max_tokens=24, temperature=0
        )
        stream = client.completions.create(
            model=cluster_fixture.served_model_name(),
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            stream=True,
        )
        streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert out.choices[0].text == offline["text"]
    assert streamed == offline["text"]
    assert net.live.metric("decode-0", "pdserve_kv_transfer_bytes_total", {"direction": "in"}) > received
    net.live.wait_clean()


def test_cut_decode_link_mid_stream_ends_cleanly(net: NetCluster) -> None:
    """D's link goes down while it streams: the client gets an error, not a hang, by the request's
    deadline; P holds nothing; D, once reachable again, has freed what the request held."""
    deadline_s = 15.0
    chunks = 0
    with _client(net, timeout_s=deadline_s + 30) as client:
        stream = client.completions.create(
            model=cluster_fixture.served_model_name(), prompt=PROMPT, max_tokens=2000, temperature=0,
            stream=True,
            extra_body={"ignore_eos": True, "timeout": deadline_s},
        )  # fmt: skip
        start = time.monotonic()
        cut_at = None
        with pytest.raises(openai.APIError) as failure:
            for chunk in stream:
                chunks += 1 if chunk.choices and chunk.choices[0].text else 0
                if chunks == 3 and cut_at is None:
                    _ip("link", "set", net.hosts.veth("decode"), "down")
                    cut_at = time.monotonic()
        ended = time.monotonic()
    assert cut_at is not None, f"the stream ended after {chunks} chunks, before the link was cut"
    assert ended - start <= deadline_s + 5.0, f"the error came {ended - start:.1f}s after the request"
    assert "deadline" in str(failure.value).lower() or "decode-0" in str(failure.value), failure.value
    prefill = net.live.audit("prefill-0")
    assert prefill["in_use"] == prefill["reserved"] == prefill["live_requests"] == 0, prefill
    _ip("link", "set", net.hosts.veth("decode"), "up")
    net.live.wait_clean(timeout_s=30)


PROBE = Path(__file__).resolve().parent.parent / "deploy" / "docker" / "probe.py"


def _probe(net: NetCluster, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """The images' health check and pre-stop hook, deploy/docker/probe.py, run from the root namespace
    with the node's credential in its environment, as the pods have it."""
    return subprocess.run(
        [sys.executable, str(PROBE), *args],
        capture_output=True, text=True, timeout=timeout_s, check=False, env=net.secret_env(),
    )  # fmt: skip


def test_probe_health_and_drain_let_the_running_request_finish(net: NetCluster) -> None:
    """`pdserve-probe drain`, the decode pods' preStop hook: D takes no new work, the request it is running
    streams to its end, the hook returns once D holds nothing, and D leaves the index."""
    hosts = net.hosts
    router = ("--role", "router", "--host", hosts.addr("router"), "--port", str(ROUTER_PORT))
    decode = ("--role", "node", "--host", hosts.addr("decode"), "--port", str(NODE_PORT))
    _wait_listed(net, "decode-0", True, timeout_s=30)  # heartbeats resume once a cut link is back
    deadline = time.monotonic() + 30  # the router serves again once it sees D back (a probe's retry)
    while _probe(net, "health", *router).returncode != 0:
        assert time.monotonic() < deadline, "the router's health did not come back with D"
        time.sleep(1)
    assert _probe(net, "health", *decode).returncode == 0
    assert (
        _probe(net, "health", "--role", "node", "--host", hosts.addr("decode"), "--port", "1").returncode == 1
    )
    with _client(net) as client:
        stream = client.completions.create(
            model=cluster_fixture.served_model_name(), prompt=PROMPT, max_tokens=64, temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = iter(stream)
        text = next(chunks).choices[0].text
        drained = _probe(net, "drain", *decode, "--timeout", "60")
        rest = list(chunks)
    text += "".join(c.choices[0].text for c in rest if c.choices)
    assert drained.returncode == 0, drained.stderr
    finish = [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"], "the running request must finish, not be cut by the drain"
    audit = net.live.audit("decode-0")
    assert audit["live_requests"] == audit["in_use"] == audit["reserved"] == 0, audit
    _wait_listed(net, "decode-0", False, timeout_s=10)  # a drained node leaves the index once idle


def _wait_listed(net: NetCluster, node_id: str, listed: bool, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while (node_id in {n["info"]["node_id"] for n in net.kvctl("nodes")["nodes"]}) != listed:
        assert time.monotonic() < deadline, (
            f"{node_id} {'not ' if listed else ''}in the index after {timeout_s}s"
        )
        time.sleep(0.5)
