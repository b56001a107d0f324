"""Redis is no trust root (issue 32): on a real cluster (redis-server, one single node, a router), a process
with Redis access only cannot steer the router to itself, capture anything replayable, drain a node, or stop
the router's membership with a malformed record; a captured signed node request replays nowhere."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx2
import pytest
import redis
from pdserve.shared.node.node_sign import signed
from pdserve.tests.harness.cluster_fixture import LiveCluster, kvctl, served_model_name, up_config
from pdserve.tests.harness.fake_http import FakeHTTP

PREFIX = "pdserve:{default}:"
CMPL = {"model": served_model_name(), "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def live() -> Iterator[LiveCluster]:
    with LiveCluster.start(up_config(prefill=0, decode=1)) as cluster:
        yield cluster


def completion(live: LiveCluster) -> str:
    r = httpx2.post(live.base + "/v1/completions", json=CMPL, timeout=120)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def router_metric(live: LiveCluster, name: str) -> float:
    text = httpx2.get(live.base + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_a_rogue_copy_of_a_node_record_gets_nothing(live: LiveCluster) -> None:
    """Copies single-0's record (credential digest, signature and all) under a new id and its own URL, and
    heartbeats it: the router never calls it, kvctl lists it as invalid, serving goes on unchanged."""
    expected = completion(live)
    r = redis.Redis.from_url(live.redis_url)
    real = {k.decode(): v for k, v in r.hgetall(PREFIX + "node:single-0").items()}  # type: ignore[union-attr]
    info = json.loads(real["info"])
    rogue = FakeHTTP(lambda _: b"{}")  # the rogue's server: answers 200 {} to anything
    info["node_id"], info["http_url"] = "single-9", rogue.url
    before = router_metric(live, "pdserve_router_invalid_node_records_total")
    stop = time.monotonic() + 4.0
    while time.monotonic() < stop:  # heartbeats, as a node would
        r.hset(PREFIX + "node:single-9", mapping={**real, "info": json.dumps(info)})
        r.sadd(PREFIX + "nodes", "single-9")
        r.set(PREFIX + "alive:single-9", real["epoch"], px=120_000)
        for _ in range(3):
            assert completion(live) == expected
        time.sleep(0.3)
    assert rogue.seen == [], rogue.seen  # no health probe, no challenge, no work: nothing reaches it
    assert router_metric(live, "pdserve_router_invalid_node_records_total") == before + 1
    nodes = kvctl(live.redis_url, "nodes")
    assert [n["info"]["node_id"] for n in nodes["nodes"]] == ["single-0"]
    assert [bad["node_id"] for bad in nodes["invalid"]] == ["single-9"]
    assert [bad["node_id"] for bad in kvctl(live.redis_url, "blocks")["invalid"]] == ["single-9"]
    r.delete(PREFIX + "node:single-9", PREFIX + "alive:single-9")
    r.srem(PREFIX + "nodes", "single-9")


def test_a_malformed_record_and_a_forged_drain_change_nothing(live: LiveCluster) -> None:
    expected = completion(live)
    r = redis.Redis.from_url(live.redis_url)
    r.hset(PREFIX + "node:broken", mapping={"info": "{not json", "epoch": "1", "load": "[]", "sig": "zz"})
    r.sadd(PREFIX + "nodes", "broken")
    r.set(PREFIX + "alive:broken", "1", px=30_000)
    r.hset(PREFIX + "node:single-0", "draining", "1")  # an unsigned drain: no effect
    r.hset(PREFIX + "node:single-0", "load", json.dumps({"draining": True}))  # a forged load: undone
    time.sleep(2.5)  # a few membership refreshes and node heartbeats
    for _ in range(3):
        assert completion(live) == expected
    assert httpx2.get(live.base + "/health", timeout=10).json()["nodes"]["single"]["ready"] == 1
    nodes = kvctl(live.redis_url, "nodes")
    assert [(n["info"]["node_id"], n["draining"]) for n in nodes["nodes"]] == [("single-0", False)]
    assert "broken" in [bad["node_id"] for bad in nodes["invalid"]]
    assert "Traceback" not in live.log("router")
    r.delete(PREFIX + "node:broken", PREFIX + "alive:broken")
    r.srem(PREFIX + "nodes", "broken")


def test_a_captured_node_request_replays_nowhere(live: LiveCluster) -> None:
    """A signed request is accepted once; the same bytes 1 s later are refused (its nonce), and so is a
    request signed with another credential or sent with the token itself as a bearer token."""
    url = live.nodes["single-0"].url + "/internal/audit"
    request = httpx2.Request("GET", url)
    auth = signed(live.auth_token)
    flow = auth.sync_auth_flow(request)
    captured = next(flow)
    assert live.auth_token not in json.dumps(dict(captured.headers))
    with httpx2.Client(timeout=10) as client:
        assert client.send(captured).status_code == 200
        time.sleep(1.0)
        again = client.send(captured)
        assert again.status_code == 401 and "nonce already used" in again.text
        assert client.get(url, auth=signed("another-token")).status_code == 401
        bearer = {"authorization": f"Bearer {live.auth_token}"}
        assert client.get(url, headers=bearer).status_code == 401


def test_a_request_outside_the_clock_window_is_refused(live: LiveCluster) -> None:
    from pdserve.shared.node.node_sign import ClusterKeys

    url = live.nodes["single-0"].url + "/internal/audit"
    old = ClusterKeys(live.auth_token).sign_request("GET", b"/internal/audit", b"", now_s=time.time() - 31)
    r = httpx2.get(url, headers={"authorization": old}, timeout=10)
    assert r.status_code == 401 and "outside the" in r.text
