"""`pdserve up`: a whole local cluster (its settings: up_options.py; one component: cli.py).

`up` owns every process it starts: Redis on a free port (no persistence, or an append-only file in the work
directory with `--redis-aof`; a Redis that dies is started again on its port), the nodes, the router. Each
child runs in its own process group and is stopped by pid (SIGTERM, then SIGKILL) on Ctrl-C, on SIGTERM,
and when any child dies during start-up, so nothing is left orphaned.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from pdserve.redis_launch import LocalRedis, free_port

MODULES = {
    "router": "pdserve.router",
    "prefill": "pdserve.prefill_node",
    "decode": "pdserve.decode_node",
    "single": "pdserve.decode_node",
}


@dataclass
class Cluster:
    """The processes of a local cluster, stopped in reverse start order."""

    procs: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)
    workdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="pdserve-"))
    redis: list[LocalRedis] = field(default_factory=list)
    auth_token: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)
    """The cluster's credential: the nodes' KV-transfer token, which the router (and kvctl) send to nodes."""
    urls: dict[str, str] = field(default_factory=dict)
    """Where each started component answers (a node's internal API, the router's OpenAI API), by name."""

    @property
    def secret_env(self) -> dict[str, str]:
        """The environment of a process that holds the credential (a secret: never on argv)."""
        return os.environ | {"PDSERVE_AUTH_TOKEN": self.auth_token}

    def spawn(
        self, name: str, argv: list[str], env: dict[str, str] | None = None, url: str = ""
    ) -> subprocess.Popen[bytes]:
        log = open(self.log_path(name), "wb")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        self.procs.append((name, proc))
        if url:
            self.urls[name] = url
        return proc

    def log_path(self, name: str) -> str:
        return os.path.join(self.workdir, f"{name}.log")

    def table(self) -> str:
        """The operator's map of the cluster: each component's role, pid, URL and log file."""
        rows = [("component", "role", "pid", "url", "log")]
        for redis in self.redis:
            rows.append(("redis", "index", str(redis.pid), redis.url, redis.log_path or "-"))
        for name, proc in self.procs:
            role = "router" if name == "router" else name.rsplit("-", 1)[0]
            rows.append((name, role, str(proc.pid), self.urls.get(name, "-"), self.log_path(name)))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        cells = [[c.ljust(w) for c, w in zip(r[:4], widths, strict=True)] + [r[4]] for r in rows]
        return "\n".join("  " + "  ".join(c) for c in cells)

    def check_alive(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                tail = self.log_tail(name)
                raise RuntimeError(f"{name} exited with code {proc.returncode}; last log lines:\n{tail}")

    def log_tail(self, name: str, lines: int = 15) -> str:
        with open(self.log_path(name), "rb") as f:
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        for _name, proc in reversed(self.procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for _name, proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()
        for redis in self.redis:
            redis.stop()
        self.redis.clear()

    def wait_http(
        self, url: str, timeout_s: float, ready: Callable[[httpx.Response], bool] | None = None
    ) -> None:
        """Until `url` answers 200 (and `ready` holds for the reply); RuntimeError when a child dies first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            with contextlib.suppress(httpx.HTTPError, ValueError):
                reply = httpx.get(url, timeout=1.0)
                if reply.status_code == 200 and (ready is None or ready(reply)):
                    return
            time.sleep(0.2)
        raise RuntimeError(f"{url} did not answer within {timeout_s:.0f}s")


def start_redis(
    cluster: Cluster, password: str | None = None, aof_dir: str | None = None, port: int = 0
) -> str:
    """Redis for the cluster's block index: a free port (or `port`), no persistence (or an append-only file
    in aof_dir), stopped with the cluster."""
    binary = shutil.which("redis-server") or LocalRedis.binary
    redis = LocalRedis(binary=binary, password=password, aof_dir=aof_dir, port=port)
    try:
        redis.start()
    except FileNotFoundError as exc:
        raise RuntimeError("redis-server not found; install it (apt-get install redis-server)") from exc
    cluster.redis.append(redis)
    return redis.url


@dataclass(frozen=True)
class UpConfig:
    model: str
    port: int = 8000
    prefill: int = 1
    decode: int = 1
    threads_per_node: int = 1
    extra_node_args: tuple[str, ...] = ()
    demo: bool = False
    # more flags for the nodes of one role ("prefill", "decode", "single"), after extra_node_args
    role_node_args: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # pinned HTTP ports of one role's nodes, one per node (a role not listed gets free ports)
    role_ports: tuple[tuple[str, tuple[int, ...]], ...] = ()
    router_args: tuple[str, ...] = ()
    redis_aof: bool = False
    """Redis keeps an append-only file in the cluster's work directory (its data survives a restart)."""


def start_cluster(cfg: UpConfig, cluster: Cluster) -> str:
    """Starts Redis, the nodes and the router; returns the router's base URL once everything answers."""
    redis_url = start_redis(
        cluster, aof_dir=os.path.join(cluster.workdir, "redis") if cfg.redis_aof else None
    )
    py = sys.executable
    urls = []
    roles = [("prefill", i) for i in range(cfg.prefill)] + [("decode", i) for i in range(cfg.decode)]
    if cfg.prefill == 0:
        roles = [("single", i) for i in range(cfg.decode)]
    pinned = dict(cfg.role_ports)
    for role, i in roles:
        port = pinned[role][i] if pinned.get(role) else free_port()
        name = f"{role}-{i}"
        argv = [
            py,
            "-m",
            MODULES[role],
            "--node-id",
            name,
            "--port",
            str(port),
            "--redis",
            redis_url,
            "--model",
            cfg.model,
            "--threads",
            str(cfg.threads_per_node),
            *cfg.extra_node_args,
            *dict(cfg.role_node_args).get(role, ()),
        ]
        if role == "single":
            argv += ["--role", "single"]
        cluster.spawn(name, argv, env=cluster.secret_env, url=f"http://127.0.0.1:{port}")
        urls.append(f"http://127.0.0.1:{port}/internal/health")
    router_argv = [
        py,
        "-m",
        "pdserve.router",
        "--model",
        cfg.model,
        "--redis",
        redis_url,
        "--port",
        str(cfg.port),
        *cfg.router_args,
    ]
    base = f"http://127.0.0.1:{cfg.port}"
    # the router starts while the nodes load (its start-up overlaps theirs) and serves once it sees them all
    cluster.spawn("router", router_argv, env=cluster.secret_env, url=base)
    for url in urls:
        cluster.wait_http(url, timeout_s=300)
    cluster.wait_http(f"{base}/health", timeout_s=120, ready=lambda r: _ready_nodes(r) == len(roles))
    return base


def _ready_nodes(health: httpx.Response) -> int:
    """How many nodes the router's /health body counts ready, over every role."""
    return sum(int(role["ready"]) for role in health.json()["nodes"].values())


def demo_request(base: str) -> str:
    models = httpx.get(f"{base}/v1/models", timeout=10).json()
    body = {
        "model": models["data"][0]["id"],
        "messages": [{"role": "user", "content": "In one sentence, what is the capital of France?"}],
        "max_tokens": 48,
        "temperature": 0,
    }
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300)
    r.raise_for_status()
    return str(r.json()["choices"][0]["message"]["content"])


def run_up(cfg: UpConfig) -> int:
    """`pdserve up` (its settings are parsed in up_options.py): serves until Ctrl-C or SIGTERM."""
    cluster = Cluster()
    stop = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True
        raise KeyboardInterrupt

    # SIGINT too, explicitly: a process started in the background by a non-interactive shell inherits SIGINT
    # ignored, and Python then installs no KeyboardInterrupt handler: Ctrl-C (or a test's SIGINT) did nothing
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        print(
            f"pdserve up: starting Redis, {cfg.prefill} prefill and {cfg.decode} decode node(s); logs in "
            f"{cluster.workdir}",
            flush=True,
        )
        base = start_cluster(cfg, cluster)
        token_file = os.path.join(cluster.workdir, "auth-token")
        with open(os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(cluster.auth_token)
        redis_url = cluster.redis[0].url
        print(
            f"pdserve up: serving the OpenAI API on {base}/v1\n"
            f"pdserve up: the block index is Redis at {redis_url} (no persistence; stops with the cluster)\n"
            f"{cluster.table()}\n"
            f"pdserve up: point kvctl at it with `kvctl --redis {redis_url} nodes`, or in a shell:\n"
            f"  export PDSERVE_REDIS={redis_url} PDSERVE_AUTH_TOKEN_FILE={token_file}\n"
            f"pdserve up: kvctl drain/undrain/evict need PDSERVE_AUTH_TOKEN_FILE={token_file} (the cluster's "
            "credential)",
            flush=True,
        )
        if cfg.demo:
            answer = demo_request(base)
            print(
                json.dumps({"question": "In one sentence, what is the capital of France?", "answer": answer}),
                flush=True,
            )
        print("pdserve up: Ctrl-C stops every process", flush=True)
        while not stop:
            cluster.check_alive()
            if not cluster.redis[0].running:  # the nodes register again, or find their data in the AOF
                old = cluster.redis.pop(0)
                old.stop()
                start_redis(cluster, aof_dir=old.aof_dir, port=old.port)
                print(f"pdserve up: Redis had stopped; started again on port {old.port}", flush=True)
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("\npdserve up: stopping", flush=True)
    except (RuntimeError, httpx.HTTPError) as exc:
        print(f"pdserve up: error: {exc}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
    return 0
