"""The router's HTTP front under hostile clients, through a real router process in front of a real node:
slowloris sockets (partial headers or bodies, one byte at a time) are closed within the header and body
timeouts and a client address holds a bounded number of connections, while normal requests go on; a 3 MB
chat body is refused before it is parsed or tokenized, and a prompt over the context before any index
lookup; a client leaving mid-body is one 499 line, not a 500 and a traceback; /docs, /openapi.json and
/redoc are off and /metrics asks for the key unless flags say otherwise; a trailing slash is served as the
route without it, never redirected.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest
from pdserve.cli.up import free_port
from pdserve.tests.harness import cluster_fixture
from pdserve.tests.harness import openai_schema as schema
from pdserve.tests.harness.chaos_faults import start_router

pytestmark = pytest.mark.slow

MODEL = cluster_fixture.served_model_name()
KEY = "key-front"
HEADER_TIMEOUT_S, BODY_TIMEOUT_S, PER_CLIENT = 3, 4, 150
SLOW_HEADERS, SLOW_BODIES = 140, 60
ATTACKER = "127.0.0.2"  # loopback too: the per-address cap counts it apart from the test's own 127.0.0.1


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[cluster_fixture.LiveCluster, str]]:
    """The cluster (its router has the short timeouts and the key) and a second router with /metrics public
    and the API docs on."""
    keys_file = cluster_fixture.secret_file(KEY)
    front = ("--header-timeout", str(HEADER_TIMEOUT_S), "--body-timeout", str(BODY_TIMEOUT_S),
             "--max-connections-per-client", str(PER_CLIENT))  # fmt: skip
    with cluster_fixture.LiveCluster.start(
        cluster_fixture.up_config(prefill=0, decode=1, router_args=("--api-keys-file", keys_file, *front))
    ) as cluster:
        open_args = ("--api-keys-file", keys_file, "--metrics-public", "--api-docs")
        yield cluster, start_router(cluster, "router-open", free_port(), *open_args)


def _auth() -> dict[str, str]:
    return {"authorization": f"Bearer {KEY}"}


def _router_pid(live: cluster_fixture.LiveCluster) -> int:
    return next(p.pid for name, p in live.cluster.procs if name == "router")


def _cpu_s(pid: int) -> float:
    """utime + stime of a process, seconds."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _metrics(base: str) -> str:
    r = httpx2.get(f"{base}/metrics", headers=_auth(), timeout=30)
    assert r.status_code == 200, r.text[:300]
    return r.text


def _error(r: httpx2.Response, *statuses: int) -> dict[str, Any]:
    assert r.status_code in statuses, (r.status_code, r.text[:300])
    schema.validate(r.json(), "ErrorResponse")
    return dict(r.json()["error"])


async def _slow_client(port: int, head: bytes, body: bytes, started: float) -> tuple[str, float]:
    """Sends `head` one byte every 0.5 s, or (with a `body`) `head` at once and then `body` one byte every
    0.5 s, until the router closes the connection; returns ("refused" | "closed", seconds from `started` to
    the close; "refused" when the router answered 429 first, or reset the connection before any timeout could
    pass: bytes the client sent before the refusal's close turn it into a reset)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(ATTACKER, 0))
    answer = asyncio.ensure_future(reader.read(4096))
    slow = body or head
    if body:
        writer.write(head)
    try:
        for i in range(len(slow)):
            if answer.done():
                break
            writer.write(slow[i : i + 1])
            await asyncio.wait([answer], timeout=0.5)
        async with asyncio.timeout(60):
            first = await answer
            while await reader.read(4096):  # until EOF
                pass
    except (ConnectionError, OSError):
        first = b"reset"
    finally:
        writer.close()
    took = time.monotonic() - started
    early = first == b"reset" and took < HEADER_TIMEOUT_S - 1
    return ("refused" if first.startswith(b"HTTP/1.1 429") or early else "closed"), took


def _normal_requests(base: str, stop_at: float) -> list[float]:
    latencies = []
    with httpx2.Client(base_url=base, headers=_auth(), timeout=60) as client:
        while time.monotonic() < stop_at:
            t0 = time.perf_counter()
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 200, r.text[:300]
            latencies.append(time.perf_counter() - t0)
    return latencies


def test_slowloris_sockets_are_closed_while_requests_go_on(
    live: tuple[cluster_fixture.LiveCluster, str],
) -> None:
    cluster, _ = live
    port = int(cluster.base.rsplit(":", 1)[1])
    alone = _normal_requests(cluster.base, time.monotonic() + 3)
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    body_head = head + f"authorization: Bearer {KEY}\r\ncontent-length: 5000\r\n\r\n".encode()

    async def attack() -> tuple[list[tuple[str, float]], list[float]]:
        started = time.monotonic()
        slow_head = head + b"x-pad: " + b"a" * 200
        clients = [_slow_client(port, slow_head, b"", started) for _ in range(SLOW_HEADERS)]
        clients += [_slow_client(port, body_head, b"{" * 5000, started) for _ in range(SLOW_BODIES)]
        normal = asyncio.to_thread(_normal_requests, cluster.base, started + BODY_TIMEOUT_S + 2)
        closes, latencies = await asyncio.gather(asyncio.gather(*clients), normal)
        return closes, latencies

    closes, during = asyncio.run(attack())
    refused = [t for kind, t in closes if kind == "refused"]
    print(f"\n{len(closes)} slow sockets from one address: {len(refused)} refused at once (cap {PER_CLIENT})")
    for what, group, timeout in (("headers", closes[:SLOW_HEADERS], HEADER_TIMEOUT_S),
                                 ("bodies", closes[SLOW_HEADERS:], BODY_TIMEOUT_S)):  # fmt: skip
        closed = [t for kind, t in group if kind == "closed"]
        if closed:
            print(f"slow {what}: {len(closed)} closed by the router after {min(closed):.1f}-"
                  f"{max(closed):.1f} s (timeout {timeout} s)")  # fmt: skip
    print(f"normal completions: alone {len(alone)}, median {sorted(alone)[len(alone) // 2] * 1e3:.0f} ms; "
          f"during the attack {len(during)}, median {sorted(during)[len(during) // 2] * 1e3:.0f} ms, "
          f"max {max(during) * 1e3:.0f} ms")  # fmt: skip
    assert len(closes) == SLOW_HEADERS + SLOW_BODIES
    assert refused, "the per-address connection cap refused no connection"
    assert max(t for _, t in closes) < BODY_TIMEOUT_S + 10  # generous slack: the bound, not a speed
    assert during, "no normal request finished during the attack"
    # the closed sockets gave their places back: the attacker's address is served again
    transport = httpx2.HTTPTransport(local_address=ATTACKER)
    with httpx2.Client(base_url=cluster.base, headers=_auth(), transport=transport, timeout=30) as again:
        assert again.get("/v1/models").status_code == 200


def test_a_3mb_chat_body_is_refused_before_tokenizing(live: tuple[cluster_fixture.LiveCluster, str]) -> None:
    cluster, _ = live
    pid = _router_pid(cluster)
    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 100_000}).encode()
    assert len(big) > 3_000_000
    before = _metrics(cluster.base)
    n = 5
    cpu0 = _cpu_s(pid)
    for _ in range(n):
        r = httpx2.post(f"{cluster.base}/v1/chat/completions", content=big, timeout=60,
                       headers={**_auth(), "content-type": "application/json"})  # fmt: skip
        _error(r, 400, 413)
    cpu = (_cpu_s(pid) - cpu0) / n
    over = {"model": MODEL, "prompt": [5] * 9000, "max_tokens": 2}  # a small body, over the context
    r = httpx2.post(f"{cluster.base}/v1/completions", json=over, headers=_auth(), timeout=60)
    assert _error(r, 400)["code"] == "context_length_exceeded"
    after = _metrics(cluster.base)
    print(f"\nrouter CPU per refused 3 MB body: {cpu * 1e3:.1f} ms (target < 50 ms)")
    for series in ("pdserve_router_tokenize_seconds_count", "pdserve_router_routing_seconds_count"):
        if series == "pdserve_router_tokenize_seconds_count":  # the prompt over the context is tokenized
            assert cluster_fixture.sample(after, series) == cluster_fixture.sample(before, series) + 1, series
        else:  # no index lookup (routing = hashing + lookup + choice) for any of them
            assert cluster_fixture.sample(after, series) == cluster_fixture.sample(before, series), series


def test_a_client_leaving_mid_body_is_one_499_line(live: tuple[cluster_fixture.LiveCluster, str]) -> None:
    cluster, _ = live
    port = int(cluster.base.rsplit(":", 1)[1])
    before = _metrics(cluster.base)
    left = "the client left before its answer (499)"
    lines = cluster.log("router").count(left)

    async def leave() -> None:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     + f"authorization: Bearer {KEY}\r\ncontent-length: 10000\r\n\r\n".encode()
                     + b'{"model": "x", "prompt": "')  # fmt: skip
        await writer.drain()
        await asyncio.sleep(0.5)
        writer.close()

    asyncio.run(leave())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        after = _metrics(cluster.base)
        if cluster_fixture.sample(
            after, "pdserve_router_requests_total", {"status": "499"}
        ) > cluster_fixture.sample(before, "pdserve_router_requests_total", {"status": "499"}):
            break
        time.sleep(0.2)
    five = ("500", "502", "503", "504")
    assert sum(
        cluster_fixture.sample(after, "pdserve_router_requests_total", {"status": s}) for s in five
    ) == sum(cluster_fixture.sample(before, "pdserve_router_requests_total", {"status": s}) for s in five)
    log = cluster.log("router")
    assert "Traceback" not in log, log[-3000:]
    assert log.count(left) == lines + 1, log[-2000:]


def test_docs_off_metrics_behind_the_key_and_no_redirect(
    live: tuple[cluster_fixture.LiveCluster, str],
) -> None:
    cluster, other = live
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert (
            _error(httpx2.get(cluster.base + path, headers=_auth(), timeout=10), 404)["code"] == "not_found"
        )
        assert httpx2.get(other + path, timeout=10).status_code == 200, path
    assert _error(httpx2.get(f"{cluster.base}/metrics", timeout=10), 401)
    assert httpx2.get(f"{cluster.base}/metrics", headers=_auth(), timeout=10).status_code == 200
    assert httpx2.get(f"{other}/metrics", timeout=10).status_code == 200  # --metrics-public
    for base in (cluster.base, other):
        listed = httpx2.get(f"{base}/v1/models", headers=_auth(), timeout=10).json()
        for path in ("/v1/models/", f"/v1/models/{MODEL}/"):
            r = httpx2.get(base + path, headers={**_auth(), "host": "evil.example"}, timeout=10)
            assert r.status_code == 200 and "location" not in r.headers, (path, r.status_code, r.headers)
        assert httpx2.get(f"{base}/v1/models/", headers=_auth(), timeout=10).json()["data"] == listed["data"]
        r = httpx2.post(f"{base}/v1/completions/", headers=_auth(), timeout=60,
                       json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})  # fmt: skip
        assert r.status_code == 200, r.text[:300]
