"""`pdserve up`: a whole local cluster (its settings: up_options.py; one component: cli/main.py).

`up` owns every process it starts: Redis on a free port, bound to 127.0.0.1 with a random password (no
persistence, or an append-only file in the work directory with `--redis-aof`; a Redis that dies is started
again on its port), the nodes, the router. Invariants:
- every port the cluster listens on is checked free before anything starts (one line if one is taken);
- each child runs in its own process group and gets the kernel's parent-death signal (SIGKILL), so a
  launcher killed outright leaves nothing running; on Ctrl-C, SIGHUP (a closed terminal) and SIGTERM every
  child is stopped by pid (SIGTERM, then SIGKILL), and the work directory (logs, the credential's file)
  and the cluster file are removed;
- a child that dies after start-up is started again with back-off (logged), while the router fails over;
  one that fails its start-up (during `up`'s own start, or 3 restarts in a row) stops the cluster;
- secrets travel by environment only: the nodes get the cluster's credential and the Redis password, the
  router those and the API keys; none is on argv.
About 420 lines, one module: starting, supervising and stopping the children are one owner's job (the
restarts reuse how each child was started; the stop must see every child ever started).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import httpx2
from pdserve.cli.redis_launch import LocalRedis, die_with_parent, free_port
from pdserve.shared.cli import cluster_file

MODULES = {
    "router": "pdserve.router",
    "prefill": "pdserve.prefill_node",
    "decode": "pdserve.decode_node",
    "single": "pdserve.decode_node",
}


_ROUTER_ONLY_SECRETS = ("PDSERVE_API_KEYS", "PDSERVE_API_KEYS_FILE")
RESTART_LIMIT = 3
"""Start-ups in a row a restarted child may fail before the cluster stops."""


@dataclass
class _Child:
    """How a child was started (to start it again) and its restart state."""

    argv: list[str]
    env: dict[str, str] | None
    health: str
    """URL that answers 200 once the child serves."""
    failures: int = 0
    """Start-ups failed in a row since it last served."""
    due: float | None = None
    """When to start it again (monotonic), while it is down."""
    serving: bool = True


@dataclass
class Cluster:
    """The processes of a local cluster, stopped in reverse start order."""

    procs: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)
    workdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="pdserve-"))
    redis: list[LocalRedis] = field(default_factory=list)
    auth_token: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)
    """The cluster's credential: the nodes' KV-transfer token, which the router (and kvctl) send to nodes."""
    redis_password: str | None = field(default=None, repr=False)
    """Redis's `requirepass` (None: no password); the children get it as PDSERVE_REDIS_PASSWORD."""
    die_with_launcher: bool = False
    """Children (Redis too) get the parent-death signal: `pdserve up` sets it (its children must not outlive
    it); tests that build clusters from helper threads leave it off."""
    urls: dict[str, str] = field(default_factory=dict)
    """Where each started component answers (a node's internal API, the router's OpenAI API), by name."""
    children: dict[str, _Child] = field(default_factory=dict)

    @property
    def secret_env(self) -> dict[str, str]:
        """The environment of a process that holds the credential (a secret: never on argv): the router's."""
        env = os.environ | {"PDSERVE_AUTH_TOKEN": self.auth_token}
        if self.redis_password is not None:
            env["PDSERVE_REDIS_PASSWORD"] = self.redis_password
        return env

    @property
    def node_env(self) -> dict[str, str]:
        """A node's environment: its own secrets only (the API keys are the router's)."""
        return {k: v for k, v in self.secret_env.items() if k not in _ROUTER_ONLY_SECRETS}

    def spawn(
        self, name: str, argv: list[str], env: dict[str, str] | None = None, url: str = "", health: str = ""
    ) -> subprocess.Popen[bytes]:
        log = open(self.log_path(name), "ab")  # noqa: SIM115 - owned by the child
        hook = die_with_parent() if self.die_with_launcher else None
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env, preexec_fn=hook
        )
        log.close()
        # a restart replaces the dead process of that name (one still running stays, to be stopped)
        self.procs = [(n, p) for n, p in self.procs if n != name or p.poll() is None] + [(name, proc)]
        self.children[name] = _Child(argv, env, health or url)
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

    def supervise(self, say: Callable[[str], None]) -> None:
        """One round of restarts: a child that died is started again after a back-off (1, 2, 4 ... 30 s),
        one that was started again is watched until it serves. RuntimeError when one failed its start-up
        RESTART_LIMIT times in a row."""
        now = time.monotonic()
        for name, proc in list(self.procs):
            child = self.children[name]
            if child.due is None and proc.poll() is not None:
                if not child.serving:
                    child.failures += 1
                if child.failures >= RESTART_LIMIT:
                    raise RuntimeError(
                        f"{name} failed its start-up {child.failures} times in a row (exit code "
                        f"{proc.returncode}); last log lines:\n{self.log_tail(name)}"
                    )
                delay = min(30.0, 2.0**child.failures)
                child.due, child.serving = now + delay, False
                say(f"{name} exited with code {proc.returncode}; starting it again in {delay:.0f} s "
                    f"(log: {self.log_path(name)})")  # fmt: skip
            elif child.due is not None and now >= child.due:
                child.due = None
                self.spawn(name, child.argv, child.env, self.urls.get(name, ""), child.health)
                self.children[name].failures = child.failures
                self.children[name].serving = False
            elif child.due is None and not child.serving:
                with contextlib.suppress(httpx2.HTTPError):
                    if httpx2.get(child.health, timeout=0.5).status_code == 200:
                        child.serving, child.failures = True, 0
                        say(f"{name} is back (pid {proc.pid})")

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
        self, url: str, timeout_s: float, ready: Callable[[httpx2.Response], bool] | None = None
    ) -> None:
        """Until `url` answers 200 (and `ready` holds for the reply); RuntimeError when a child dies first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            with contextlib.suppress(httpx2.HTTPError, ValueError):
                reply = httpx2.get(url, timeout=1.0)
                if reply.status_code == 200 and (ready is None or ready(reply)):
                    return
            time.sleep(0.2)
        raise RuntimeError(f"{url} did not answer within {timeout_s:.0f}s")


def start_redis(cluster: Cluster, aof_dir: str | None = None, port: int = 0) -> str:
    """Redis for the cluster's block index: a free port (or `port`) on 127.0.0.1, the cluster's password,
    no persistence (or an append-only file in aof_dir), stopped with the cluster."""
    binary = shutil.which("redis-server") or LocalRedis.binary
    redis = LocalRedis(
        binary=binary, password=cluster.redis_password, aof_dir=aof_dir, port=port,
        die_with_parent=cluster.die_with_launcher,
    )  # fmt: skip
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
    name: str = "default"
    """The cluster file's name (kvctl --cluster NAME)."""


def check_ports_free(cfg: UpConfig) -> None:
    """RuntimeError naming the first port the cluster would listen on that something already holds."""
    wanted = [(cfg.port, "the router's --port")]
    for role, ports in cfg.role_ports:
        wanted += [(port, f"--{'prefill' if role == 'prefill' else 'decode'}-ports") for port in ports]
    for port, what in wanted:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds it
            try:
                probe.bind(("127.0.0.1", port))
            except OSError as exc:
                raise RuntimeError(
                    f"port {port} ({what}) is in use ({exc.strerror}): stop what holds it or pick another "
                    "port"
                ) from None


def start_cluster(cfg: UpConfig, cluster: Cluster) -> str:
    """Starts Redis, the nodes and the router; returns the router's base URL once everything answers."""
    check_ports_free(cfg)
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
        url = f"http://127.0.0.1:{port}"
        cluster.spawn(name, argv, env=cluster.node_env, url=url, health=f"{url}/internal/health")
        urls.append(f"{url}/internal/health")
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
    cluster.spawn("router", router_argv, env=cluster.secret_env, url=base, health=f"{base}/health")
    for url in urls:
        cluster.wait_http(url, timeout_s=300)
    cluster.wait_http(f"{base}/health", timeout_s=120, ready=lambda r: _ready_nodes(r) == len(roles))
    return base


def _ready_nodes(health: httpx2.Response) -> int:
    """How many nodes the router's /health body counts ready, over every role."""
    return sum(int(role["ready"]) for role in health.json()["nodes"].values())


DEMO_QUESTION = "In one sentence, what is the capital of France?"


def demo_request(base: str) -> str:
    models = httpx2.get(f"{base}/v1/models", timeout=10).json()
    body = {
        "model": models["data"][0]["id"],
        "messages": [{"role": "user", "content": DEMO_QUESTION}],
        "max_tokens": 48,
        "temperature": 0,
    }
    r = httpx2.post(f"{base}/v1/chat/completions", json=body, timeout=300)
    r.raise_for_status()
    return str(r.json()["choices"][0]["message"]["content"])


def _say(line: str, err: bool = False) -> None:
    """One line to the launcher's terminal; a terminal already closed (SIGHUP) is not an error."""
    with contextlib.suppress(OSError):
        print(f"pdserve up: {line}", file=sys.stderr if err else sys.stdout, flush=True)


def run_up(cfg: UpConfig, environ: Mapping[str, str]) -> int:
    """`pdserve up` (its settings are parsed in up_options.py): serves until Ctrl-C, SIGHUP or SIGTERM.
    `environ` locates the cluster file (XDG_RUNTIME_DIR, HOME)."""
    directory = cluster_file.cluster_dir(environ)
    running = cluster_file.live(directory).get(cfg.name)
    if running is not None:
        _say(f"error: a cluster named {cfg.name!r} is already up (pid {running.pid}, {running.router_url}): "
             "stop it or give --name OTHER", err=True)  # fmt: skip
        return 1
    try:
        check_ports_free(cfg)
    except RuntimeError as exc:
        _say(f"error: {exc}", err=True)
        return 1
    cluster = Cluster(redis_password=secrets.token_urlsafe(24), die_with_launcher=True)
    stop = False
    code = 0
    written: str | None = None

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True
        raise KeyboardInterrupt

    # SIGINT too, explicitly: a process started in the background by a non-interactive shell inherits SIGINT
    # ignored, and Python then installs no KeyboardInterrupt handler: Ctrl-C (or a test's SIGINT) did nothing.
    # SIGHUP: the terminal closed; its default would end the launcher without stopping anything.
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_signal)
    token_file = os.path.join(cluster.workdir, "auth-token")
    try:
        roles = f"{cfg.prefill} prefill and {cfg.decode} decode node(s)"
        _say(f"starting Redis, {roles}; logs in {cluster.workdir}")
        base = start_cluster(cfg, cluster)
        with open(os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(cluster.auth_token)
        redis_url = cluster.redis[0].url
        nodes = {name: url for name, url in cluster.urls.items() if name != "router"}
        written = cluster_file.write(directory, cluster_file.ClusterFile(
            cfg.name, os.getpid(), redis_url, cluster.redis_password or "", base, token_file, nodes=nodes,
        ))  # fmt: skip
        _say(
            f"serving the OpenAI API on {base}/v1\n"
            f"pdserve up: the block index is Redis at {redis_url} (password required; no persistence; stops "
            f"with the cluster)\n{cluster.table()}\n"
            f"pdserve up: kvctl finds this cluster through {written}: run `kvctl nodes` (or "
            f"`kvctl nodes --cluster {cfg.name}` while several clusters run); it holds the Redis password "
            "and names the credential's file, which every kvctl command needs"
        )
        if cfg.demo:
            answer = demo_request(base)
            _say(json.dumps({"question": DEMO_QUESTION, "answer": answer}))
        _say("Ctrl-C stops every process")
        while not stop:
            cluster.supervise(_say)
            if not cluster.redis[0].running:  # the nodes register again, or find their data in the AOF
                old = cluster.redis.pop(0)
                old.stop()
                start_redis(cluster, aof_dir=old.aof_dir, port=old.port)
                _say(f"Redis had stopped; started again on port {old.port}")
            time.sleep(0.5)
    except KeyboardInterrupt:
        with contextlib.suppress(OSError):
            print(flush=True)
        _say("stopping")
    except (RuntimeError, httpx2.HTTPError) as exc:
        _say(f"error: {exc}", err=True)
        code = 1
    finally:
        cluster.stop()
        if written is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(written)
        with contextlib.suppress(FileNotFoundError):
            os.remove(token_file)
        if code == 0 or not cluster.children:
            shutil.rmtree(cluster.workdir, ignore_errors=True)
        else:
            _say(f"the logs are kept in {cluster.workdir}", err=True)
    return code
