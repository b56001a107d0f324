"""End to end through two prefill and two decode nodes: prompts without a cached prefix spread over both
P and both D; a prompt sharing a long prefix with an earlier one goes to the node that holds it and only
its new blocks are computed (node logs, node and router metrics, `kvctl where` and `kvctl stats` agree);
`kvctl drain` moves new work off a node, and no request fails right after it. One cluster serves the module;
the drain tests run last because a drained node stays drained.
"""

from __future__ import annotations

import http.client
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx2
import pytest
from pdserve.shared.node.node_protocol import CLIENT_KEEPALIVE_S, NODE_KEEPALIVE_S
from pdserve.shared.node.node_sign import ClusterKeys
from pdserve.shared.types import KVSource
from pdserve.tests.harness import cluster_fixture

pytestmark = pytest.mark.slow

MODEL = cluster_fixture.served_model_name()
PREFILL = ("prefill-0", "prefill-1")
DECODE = ("decode-0", "decode-1")
PREFIX = " ".join(
    f"Clause {i}: the tenant shall keep the premises at number {i} in good repair and pay rent on day {i}."
    for i in range(1, 15)
)
WORDS = ("Apples", "Bridges", "Comets", "Deserts", "Engines", "Forests", "Glaciers", "Harbours")


@pytest.fixture(scope="module")
def live() -> Iterator[cluster_fixture.LiveCluster]:
    yield from cluster_fixture.live_cluster(prefill=2, decode=2)


def complete(live: cluster_fixture.LiveCluster, prompt: str, max_tokens: int = 4) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = httpx2.post(f"{live.base}/v1/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    reply: dict[str, Any] = r.json()
    return reply


def prefill_lines(live: cluster_fixture.LiveCluster, node: str) -> dict[str, tuple[int, int]]:
    """request id -> (prompt tokens, cached tokens), from `prefill <id>: N tokens, C cached` log lines."""
    pattern = re.compile(r"prefill (\S+): (\d+) tokens, (\d+) cached")
    return {m[1]: (int(m[2]), int(m[3])) for m in pattern.finditer(live.log(node))}


def prefilled_on(live: cluster_fixture.LiveCluster, response_id: str) -> str:
    holders = [n for n in PREFILL if f"{response_id}-0" in prefill_lines(live, n)]
    assert len(holders) == 1, f"{response_id} prefilled on {holders}"
    return holders[0]


def prompt_tokens(live: cluster_fixture.LiveCluster) -> dict[str, float]:
    return {n: live.metric(n, "pdserve_node_prompt_tokens_total") for n in (*PREFILL, *DECODE)}


def test_requests_without_a_cached_prefix_spread_over_every_node(live: cluster_fixture.LiveCluster) -> None:
    before = prompt_tokens(live)
    prompts = [f"{w} are interesting because" for w in WORDS]
    with ThreadPoolExecutor(max_workers=2) as pool:
        replies = list(pool.map(lambda p: complete(live, p), prompts))
    served = {prefilled_on(live, r["id"]) for r in replies}
    assert served == set(PREFILL), f"every prompt prefilled on {served}"
    after = prompt_tokens(live)
    idle = [n for n in (*PREFILL, *DECODE) if after[n] == before[n]]
    assert not idle, f"nodes {idle} got none of {len(prompts)} requests"
    live.wait_clean()


def test_shared_prefix_goes_to_its_holder_and_only_new_blocks_are_computed(
    live: cluster_fixture.LiveCluster,
) -> None:
    first = complete(live, PREFIX + " Question: who repairs the premises?")
    prefix_tokens = first["usage"]["prompt_tokens"]
    assert prefix_tokens >= 256 + 8, f"the shared prefix must be >= 256 tokens, prompt has {prefix_tokens}"
    holder = prefilled_on(live, first["id"])
    other = next(n for n in PREFILL if n != holder)
    deadline = time.monotonic() + 10
    while True:
        where = {
            r["node_id"]: r["prefix_blocks"]
            for r in cluster_fixture.kvctl(live.redis_url, "where", "--prompt", PREFIX)["nodes"]
        }
        if where.get(holder, 0) >= 16 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert where[holder] >= 256 // 16, f"kvctl where: {where}"
    assert where[other] == 0, f"kvctl where: {where}"
    hits_before = live.metric(holder, "pdserve_node_prefix_hit_tokens_total", {"kind": "local"})
    metrics_before = httpx2.get(f"{live.base}/metrics").text
    router_before = cluster_fixture.sample(
        metrics_before, "pdserve_router_prefix_hit_tokens_total", {"kind": "local"}
    )

    second = complete(live, PREFIX + " Question: on which day is rent due?")
    assert prefilled_on(live, second["id"]) == holder
    total, cached = prefill_lines(live, holder)[f"{second['id']}-0"]
    assert cached >= 256 and total - cached <= 2 * 16 + 16, f"prefill computed {total - cached} of {total}"
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256
    hits = live.metric(holder, "pdserve_node_prefix_hit_tokens_total", {"kind": "local"}) - hits_before
    assert hits == cached
    metrics = httpx2.get(f"{live.base}/metrics").text
    router_hits = cluster_fixture.sample(metrics, "pdserve_router_prefix_hit_tokens_total", {"kind": "local"})
    assert router_hits - router_before >= 256
    assert (
        cluster_fixture.sample(metrics, "pdserve_router_prefix_hit_tokens_total", {"kind": "remote"}) == 0
    )  # no fetch
    on_holder = {"kind": "pd", "node_id": holder}

    def added(name: str) -> float:
        return cluster_fixture.sample(metrics, name, on_holder) - cluster_fixture.sample(
            metrics_before, name, on_holder
        )

    estimate = added("pdserve_router_decision_prefill_tokens_sum")
    assert total - cached <= estimate <= total - 256, f"the router expected {estimate} of {total} computed"
    assert added("pdserve_router_decision_score_sum") >= estimate
    for name in ("pdserve_router_decision_prefill_tokens", "pdserve_router_decision_score"):
        assert added(f"{name}_count") == 1, f"{name}: one decision for the holder"
    stats = cluster_fixture.kvctl(live.redis_url, "stats")
    assert stats["nodes"][holder]["local_tokens"] >= 256
    live.wait_clean()


def router_hits(live: cluster_fixture.LiveCluster) -> dict[str, float]:
    text = httpx2.get(f"{live.base}/metrics", timeout=10).text
    return {
        k: cluster_fixture.sample(text, "pdserve_router_prefix_hit_tokens_total", {"kind": k})
        for k in KVSource
    }


def test_a_rejected_prompt_counts_no_prefix_hits_or_misses(live: cluster_fixture.LiveCluster) -> None:
    """Issue 31 point 5: a prompt the router refuses (400: longer than the context) was never placed, so
    neither the router's hit counters nor the index's statistics (kvctl stats) count it."""
    before, stats_before = router_hits(live), cluster_fixture.kvctl_main(live.redis_url, "stats")["overall"]
    body = {"model": MODEL, "prompt": [1000 + i % 1000 for i in range(9000)], "max_tokens": 4}
    r = httpx2.post(f"{live.base}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    time.sleep(0.5)  # what the router records in the index is written in the background
    assert router_hits(live) == before
    assert (
        cluster_fixture.kvctl_main(live.redis_url, "stats")["overall"]["total_tokens"]
        == stats_before["total_tokens"]
    )


def test_kvctl_stats_hit_rate_is_the_prefill_nodes(live: cluster_fixture.LiveCluster) -> None:
    """Issue 31 point 5: over a shared-prefix workload (and a refused prompt among it), kvctl stats' tokens
    per prefill node are the node's own vllm:prefix_cache_queries and hits, so their hit rates agree."""

    def nodes() -> dict[str, tuple[float, float]]:
        return {
            n: (
                live.metric(n, "vllm:prefix_cache_hits_total"),
                live.metric(n, "vllm:prefix_cache_queries_total"),
            )
            for n in PREFILL
        }

    def index() -> dict[str, tuple[int, int]]:
        rows = cluster_fixture.kvctl_main(live.redis_url, "stats")["nodes"]
        return {
            n: (rows.get(n, {}).get("local_tokens", 0), rows.get(n, {}).get("total_tokens", 0))
            for n in PREFILL
        }

    node_before, index_before = nodes(), index()
    for i, question in enumerate(("who repairs the premises?", "when is rent due?", "who holds the keys?")):
        complete(live, f"{PREFIX} Question {i}: {question}")
        if i == 1:
            body = {"model": MODEL, "prompt": [1000 + j % 1000 for j in range(9000)], "max_tokens": 4}
            assert httpx2.post(f"{live.base}/v1/completions", json=body, timeout=60).status_code == 400
    node_after = nodes()
    deadline = time.monotonic() + 10
    while True:
        index_after = index()
        added = {n: [a - b for a, b in zip(index_after[n], index_before[n], strict=True)] for n in PREFILL}
        on_nodes = {n: [a - b for a, b in zip(node_after[n], node_before[n], strict=True)] for n in PREFILL}
        if added == on_nodes or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert added == on_nodes, f"kvctl stats (hits, queries) {added}, the nodes' vllm counters {on_nodes}"
    hits = sum(h for h, _ in added.values())
    queries = sum(q for _, q in added.values())
    assert queries > 0 and hits / queries > 0.5, f"a shared prefix: {hits} of {queries} tokens cached"
    live.wait_clean()


def test_node_keeps_an_idle_connection_longer_than_the_routers_pool(
    live: cluster_fixture.LiveCluster,
) -> None:
    """A node's HTTP server outlives the router's keep-alive: a connection idle past the router's pool expiry
    still carries the next request, so the router never reuses a connection the node is closing."""
    url = httpx2.URL(live.nodes[PREFILL[0]].url)
    assert url.host is not None and url.port is not None
    conn = http.client.HTTPConnection(url.host, url.port, timeout=10)
    try:
        for i in range(2):
            if i:
                time.sleep(CLIENT_KEEPALIVE_S + 1.0)  # a 5 s server keep-alive closes the connection here
            signature = ClusterKeys(live.auth_token).sign_request("GET", b"/internal/info", b"")
            conn.request("GET", "/internal/info", headers={"authorization": signature})
            reply = conn.getresponse()
            assert reply.status == 200
            reply.read()
    finally:
        conn.close()
    assert NODE_KEEPALIVE_S > CLIENT_KEEPALIVE_S + 1.0


def test_no_request_fails_right_after_a_drain(live: cluster_fixture.LiveCluster) -> None:
    """Requests routed within the router's node-list reuse window after `kvctl drain` still succeed."""
    time.sleep(
        1.1
    )  # let the router's node list age out, so that /health reads it afresh just before the drain
    assert httpx2.get(f"{live.base}/health", timeout=10).status_code == 200
    for node in ("prefill-0", "decode-0"):
        reply = cluster_fixture.kvctl_main(live.redis_url, "drain", node)
        assert reply["draining"] is True and reply["node_reply"]["draining"] is True
    body = {"model": MODEL, "max_tokens": 3, "temperature": 0}
    with ThreadPoolExecutor(max_workers=4) as pool:
        replies = list(
            pool.map(
                lambda w: httpx2.post(
                    f"{live.base}/v1/completions", json=body | {"prompt": f"{w} drained are"}, timeout=180
                ),
                WORDS[:4],
            )
        )
    live.wait_clean()
    failed = [f"{r.status_code} {r.text}" for r in replies if r.status_code != 200]
    assert not failed, f"requests failed while nodes drained: {failed}"


def test_drained_nodes_get_no_new_work(live: cluster_fixture.LiveCluster) -> None:
    time.sleep(1.5)  # past the router's node-list reuse window (see the test above)
    before = prompt_tokens(live)
    replies = [complete(live, f"{w} after the drain are") for w in WORDS[4:]]
    assert {prefilled_on(live, r["id"]) for r in replies} == {"prefill-1"}
    after = prompt_tokens(live)
    assert after["decode-0"] == before["decode-0"], "the drained decode node got new work"
    assert after["decode-1"] > before["decode-1"]
    live.wait_clean()
    listed = {
        n["info"]["node_id"]: n["draining"] for n in cluster_fixture.kvctl(live.redis_url, "nodes")["nodes"]
    }
    assert listed.get("prefill-0", True) and listed.get("decode-0", True), f"kvctl nodes: {listed}"
