"""Regression tests of issue 17 ("Ordinary traffic must not fail"), one per defect, each through real
processes: a real redis-server, real nodes and router started as `pdserve up` starts them
(tests/harness/cluster_fixture.py), the real command-line tools. Each failing scenario ends with the audits of
every node clean (in_use = reserved = 0 with no live request).

Functions are named after the defect they pin: test_defect3_* (Redis restarted empty), test_defect4_* (a node
with another credential), test_defect5_* (/health), test_defect6_* (what the operator sees; what `pdserve up`
prints: tests/test_launcher.py), test_defect7_* (a plain clone tests itself).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from pdserve.cli.redis_launch import LocalRedis
from pdserve.cli.up import Cluster, free_port, start_redis
from pdserve.shared.engine.sampling_params import SamplingParams
from pdserve.shared.node.node_protocol import NodeGenerateRequest
from pdserve.shared.node.node_sign import signed
from pdserve.shared.types import RequestId
from pdserve.tests.harness import cluster_fixture

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent


def test_defect7_a_plain_clone_tests_itself(tmp_path: Path) -> None:
    """The repository's own files, copied where nothing lies beside them (no ../shared), run the tests that
    validate bodies against OpenAI's schemas."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    clone = tmp_path / "clone" / "pdserve"
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, clone / name)
    (clone / ".build").mkdir()
    (clone / ".build" / "pdserve").symlink_to("..")
    assert not (clone.parent / "shared").exists()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_router_openai.py"],
        cwd=clone, env=os.environ | {"PYTHONPATH": str(clone / ".build")}, capture_output=True, text=True,
        timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


# --- one cluster built step by step: Redis and the router first, then the nodes ---------------------------
# The tests below share it and run in file order: each starts from the state the one before left.

TOKEN = "h17-cluster-credential-5b2e"
OTHER_TOKEN = "h17-another-credential-90c4"
SMALL_KV = ("--kv-cache-gib", "0.125")
"""182 blocks of 16 tokens per node: enough here, and 0.9 GiB less memory each on the shared CI machine."""
NONE = {"ready": 0, "draining": 0, "down": 0}
"""/health's count of one role's nodes when there is none."""
MODEL = cluster_fixture.served_model_name()
SYSTEM = (
    "You are a terse assistant for a shipping company. Answer in one short sentence, name the port, "
    "and never mention the weather."
)


def _chat(question: str, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


def _wait(what: str, cond: Callable[[], Any], timeout_s: float, poll_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f}s"
        time.sleep(poll_s)


def _answers(url: str) -> bool:
    with contextlib.suppress(httpx2.HTTPError):
        httpx2.get(url, timeout=2)
        return True
    return False


def _listed(live: cluster_fixture.LiveCluster) -> dict[str, dict[str, Any]]:
    """Live nodes in the index, by id (kvctl nodes --json)."""
    return {n["info"]["node_id"]: n for n in cluster_fixture.kvctl_main(live.redis_url, "nodes")["nodes"]}


def _health(live: cluster_fixture.LiveCluster) -> httpx2.Response:
    return httpx2.get(f"{live.base}/health", timeout=10)


def _start_node(
    live: cluster_fixture.LiveCluster, role: str, name: str, token: str = TOKEN
) -> subprocess.Popen[bytes]:
    port = free_port()
    proc = live.cluster.spawn(
        name, cluster_fixture.node_argv(role, name, port, live.redis_url, token, *SMALL_KV)
    )
    live.nodes[name] = cluster_fixture.NodeProc(name, f"http://127.0.0.1:{port}", token)
    return proc


def _wait_node_up(live: cluster_fixture.LiveCluster, proc: subprocess.Popen[bytes], name: str) -> None:
    def up() -> bool:
        assert proc.poll() is None, f"{name} exited {proc.returncode}:\n{live.log(name)[-3000:]}"
        return name in _listed(live)

    _wait(f"{name} registered", up, timeout_s=300, poll_s=1.0)


def _restart_redis_empty(live: cluster_fixture.LiveCluster, down_s: float) -> None:
    """Stops the index's redis-server, waits down_s, and starts an empty one on the same port."""
    old = live.cluster.redis[0]
    port = old.port
    old.stop()
    time.sleep(down_s)
    live.cluster.redis[0] = LocalRedis(binary=old.binary, port=port).start()


@pytest.fixture(scope="module")
def staged() -> Iterator[cluster_fixture.LiveCluster]:
    cluster = Cluster(auth_token=TOKEN)
    with cluster_fixture.stopped_on_failure(cluster):
        redis_url = start_redis(cluster)
        port = free_port()
        cluster.spawn("router", cluster_fixture.router_argv(port, redis_url), env=cluster.secret_env)
        base = f"http://127.0.0.1:{port}"
        _wait("the router answers", lambda: _answers(f"{base}/health"), 120)
        live = cluster_fixture.LiveCluster(cluster, base, redis_url, {}, TOKEN)
    try:
        yield live
    finally:
        live.stop()


def test_defect5_health_is_503_while_no_pair_can_serve(staged: cluster_fixture.LiveCluster) -> None:
    live = staged
    r = _health(live)
    assert r.status_code == 503, r.text  # no node at all
    body = r.json()
    assert body["status"] != "ok" and body["index"] == "ok", body
    assert all(c == NONE for c in body["nodes"].values()), body
    proc = _start_node(live, "prefill", "prefill-0")
    _wait_node_up(live, proc, "prefill-0")
    r = _wait("the router sees prefill-0", lambda: _health_if(live, "prefill", "ready"), 10)
    assert r.status_code == 503, r.text  # a prefill node alone serves nothing
    assert r.json()["nodes"]["decode"] == NONE
    refused = httpx2.post(f"{live.base}/v1/chat/completions", json=_chat("Where is Rotterdam?"), timeout=60)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_nodes", refused.text
    live.wait_clean()


def test_defect4_a_node_with_another_credential_is_refused_at_registration(
    staged: cluster_fixture.LiveCluster,
) -> None:
    live = staged
    proc = _start_node(live, "decode", "decode-other", OTHER_TOKEN)

    def ended() -> bool:
        assert "decode-other" not in _listed(live), "a node with another credential registered as ready"
        return proc.poll() is not None

    _wait("the node with another credential stops", ended, timeout_s=300, poll_s=0.5)
    del live.nodes["decode-other"]
    log = live.log("decode-other")
    assert proc.returncode != 0, log[-2000:]
    assert "Traceback" not in log, log[-3000:]
    last = log.strip().splitlines()[-1]
    assert "credential" in last and "refused" in last, last  # one line naming the mismatch
    assert OTHER_TOKEN not in log and TOKEN not in log  # the digest is compared, never the token
    r = _health(live)
    assert r.status_code == 503 and r.json()["nodes"]["decode"] == NONE, r.text
    live.wait_clean()


def test_defect5_health_is_200_once_a_pair_can_serve(staged: cluster_fixture.LiveCluster) -> None:
    live = staged
    proc = _start_node(live, "decode", "decode-0")
    _wait_node_up(live, proc, "decode-0")
    r = _wait("/health 200", lambda: (x := _health(live)).status_code == 200 and x, 10)
    body = r.json()
    assert body["status"] == "ok" and body["index"] == "ok", body
    assert body["nodes"]["prefill"]["ready"] == 1 and body["nodes"]["decode"]["ready"] == 1, body
    ok = httpx2.post(f"{live.base}/v1/chat/completions", json=_chat("Where is Hamburg?"), timeout=180)
    assert ok.status_code == 200, ok.text
    live.wait_clean()


def test_defect6_the_router_logs_start_up_every_request_and_every_5xx(
    staged: cluster_fixture.LiveCluster,
) -> None:
    live = staged
    late = httpx2.post(f"{live.base}/v1/chat/completions", json=_chat("Where is Antwerp?", timeout=0.001),
                      timeout=60)  # fmt: skip
    assert late.status_code == 504, late.text
    request_id = late.headers["x-request-id"]
    live.wait_clean()
    log = _wait("the router's log line", lambda: (x := live.log("router")) and request_id in x and x, 10)
    start_up = next((line for line in log.splitlines() if "router" in line and MODEL in line), "")
    assert live.redis_url.split("/0")[0] in start_up and "nodes" in start_up, log[:3000]
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in log, log[-3000:]  # the access log
    assert '"GET /health HTTP/1.1" 503' in log, log[-3000:]
    (line,) = [line for line in log.splitlines() if request_id in line]
    assert "504" in line and "deadline" in line, line


def _blocks_settled(
    live: cluster_fixture.LiveCluster, names: tuple[str, ...]
) -> dict[str, dict[str, Any]] | None:
    """The index's view of the nodes once each lists exactly the blocks it holds (and holds some)."""
    listed = _listed(live)
    ok = all(
        n in listed
        and listed[n]["load"]
        and listed[n]["blocks_indexed"] == listed[n]["load"]["blocks_held"] > 0
        for n in names
    )
    return listed if ok else None


def test_defect3_nodes_register_again_and_resync_after_redis_restarts_empty(
    staged: cluster_fixture.LiveCluster,
) -> None:
    live = staged
    names = ("prefill-0", "decode-0")
    body = _chat("Which port is the largest in Europe?", max_tokens=12)
    first = httpx2.post(f"{live.base}/v1/chat/completions", json=body, timeout=180)
    assert first.status_code == 200, first.text
    before = _wait("records settle", lambda: _blocks_settled(live, names), 20)
    logged = {n: len(live.log(n)) for n in names}
    _restart_redis_empty(live, down_s=5.0)  # 5 s of heartbeats and ~100 publish ticks against no Redis
    after = _wait(
        "both nodes back in the index, every held block listed", lambda: _blocks_settled(live, names), 15
    )
    for n in names:
        assert after[n]["info"]["epoch"] > before[n]["info"]["epoch"], (before[n], after[n])
        assert after[n]["blocks_indexed"] >= before[n]["blocks_indexed"], (before[n], after[n])
    again = httpx2.post(f"{live.base}/v1/chat/completions", json=body, timeout=180)
    assert again.status_code == 200, again.text
    assert again.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
    for n in names:
        lines = live.log(n)[logged[n] :].splitlines()
        trouble = [line for line in lines if "WARNING" in line or "ERROR" in line]
        assert 1 <= len(trouble) <= 3, "\n".join(trouble[:20])  # once when it went, once when it came back
        assert sum("index reachable again" in line for line in lines) == 1, "\n".join(lines[-20:])
    live.wait_clean()


def test_defect3_a_draining_node_is_still_draining_after_redis_restarts(
    staged: cluster_fixture.LiveCluster,
) -> None:
    """decode-0 drained with a request running, then Redis restarts empty: it registers again as draining
    (the router gives it nothing new); once the request's client leaves, it deregisters and holds nothing.
    The request is sent to decode-0 as the router sends a local prefill (its /internal/generate), so it runs
    there from the first step whatever P does."""
    live = staged
    node = live.nodes["decode-0"]
    params = SamplingParams(max_tokens=1500, ignore_eos=True)
    gen = NodeGenerateRequest(RequestId(f"drain-{os.getpid()}"), tuple(range(100, 140)), params, None,
                              time.time() + 300)  # fmt: skip
    url = f"{node.url}/internal/generate"
    with httpx2.stream("POST", url, content=gen.to_json(), auth=signed(TOKEN), timeout=300) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines)  # its first step
        cluster_fixture.kvctl_main(live.redis_url, "drain", "decode-0")
        assert live.audit("decode-0")["live_requests"] == 1, f"the request ended: {[*lines][-1:]}"
        _restart_redis_empty(live, down_s=0.5)
        listed = _wait("decode-0 registered again", lambda: _listed(live).get("decode-0"), 10, poll_s=0.1)
        assert listed["draining"] and listed["info"]["epoch"] > 1, listed
        health = _wait(
            "the router sees decode-0 draining", lambda: _health_if(live, "decode", "draining"), 10
        )
        assert health.status_code == 503, health.text
        assert live.audit("decode-0")["live_requests"] == 1  # still running: its client leaves now
    _wait("decode-0 leaves the index once idle", lambda: "decode-0" not in _listed(live), 30)
    live.wait_clean()
    cluster_fixture.kvctl_main(live.redis_url, "undrain", "decode-0", "--url", node.url)
    _wait("/health 200 again", lambda: _health(live).status_code == 200, 15)


def _health_if(live: cluster_fixture.LiveCluster, role: str, state: str) -> httpx2.Response | None:
    """The router's /health once it counts a `role` node as `state`."""
    r = _health(live)
    return r if r.json()["nodes"][role][state] else None
