"""A drain that keeps the cache (issue 39), through real processes (redis-server, two prefill nodes, one
decode node, the router) on SmolLM2: `kvctl drain NODE --move-prefixes` of the prefill node holding a shared
~1k-token prefix moves it to the other prefill node (the one the router sends that prefix to next), the index
learns the new holder, and the next request with that prefix skips its prefill there (the receiving node's
counters: local hits on moved blocks, nothing fetched) with the greedy reference's text. Then that node
drains with --move-prefixes while the only other prefill node has a tiny KV pool (no room anywhere): the
drain degrades to a plain one, says why on the command and in the node's log, and the node still leaves the
index; every node's audit ends clean (no block left in use or reserved).
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest
from pdserve.cli.up import free_port
from pdserve.kvctl.commands import tokenize
from pdserve.tests.harness import cluster_fixture

pytestmark = pytest.mark.slow

PREFILL = ("prefill-0", "prefill-1")
PREFIX = " ".join(
    f"Rule {i}: the tenant at flat {i} pays {i * 7} euros on day {i % 28 + 1} and keeps the stairs clean."
    for i in range(1, 37)
)
QUESTIONS = (" Question: who cleans the stairs?", " Question: what does flat 5 pay?", " Summary:")
MAX_TOKENS = 8
BS = 16
KV = ("--kv-cache-gib", "0.125")
TINY = "prefill-tiny"
DECODE = ("decode-0", "decode-1")


@pytest.fixture
def live() -> Iterator[cluster_fixture.LiveCluster]:
    yield from cluster_fixture.live_cluster(prefill=2, decode=1, extra_node_args=KV)


@pytest.fixture
def live_2d() -> Iterator[cluster_fixture.LiveCluster]:
    yield from cluster_fixture.live_cluster(prefill=1, decode=2, extra_node_args=KV)


@pytest.fixture(scope="module")
def cold() -> list[str]:
    return cluster_fixture.reference_texts([{"prompt": PREFIX + q} for q in QUESTIONS], MAX_TOKENS, *KV)


def complete(live: cluster_fixture.LiveCluster, prompt: str) -> dict[str, Any]:
    body = {
        "model": cluster_fixture.served_model_name(),
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    r = httpx2.post(f"{live.base}/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    reply: dict[str, Any] = r.json()
    return reply


def where(live: cluster_fixture.LiveCluster, prompt: str) -> dict[str, int]:
    rows = cluster_fixture.kvctl_main(live.redis_url, "where", "--prompt", prompt)["nodes"]
    return {r["node_id"]: r["prefix_blocks"] for r in rows}


def wait_for(what: str, check: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"waited {timeout_s:.0f}s for {what}"
        time.sleep(0.3)


def live_nodes(live: cluster_fixture.LiveCluster) -> set[str]:
    return {n["info"]["node_id"] for n in cluster_fixture.kvctl_main(live.redis_url, "nodes")["nodes"]}


def test_drain_moves_the_hot_prefix_then_degrades_without_room(
    live: cluster_fixture.LiveCluster, cold: list[str]
) -> None:
    prefix_blocks = len(tokenize(cluster_fixture.model_path(), PREFIX, None)) // BS
    assert prefix_blocks * BS >= 900, "the shared prefix is about 1k tokens"
    first = complete(live, PREFIX + QUESTIONS[0])
    assert first["choices"][0]["text"] == cold[0]
    holder = next(n for n in PREFILL if f"prefill {first['id']}-0:" in live.log(n))
    other = next(n for n in PREFILL if n != holder)
    second = complete(live, PREFIX + QUESTIONS[1])  # hits the prefix on the holder: it is hot there
    assert second["choices"][0]["text"] == cold[1]
    assert f"prefill {second['id']}-0:" in live.log(holder)

    def only_on_holder() -> bool:
        held = where(live, PREFIX)
        return held.get(holder, 0) >= prefix_blocks - 1 and held.get(other, 0) == 0

    wait_for("the index to list the prefix on the holder only", only_on_holder)

    reply = cluster_fixture.kvctl(live.redis_url, "drain", holder, "--move-prefixes")
    moved = reply["prefixes"]
    assert moved["degraded"] is None, moved
    assert moved["prefixes_moved"] >= 1 and moved["bytes_moved"] > 0, moved
    hottest = moved["chains"][0]
    assert hottest["target"] == other and hottest["hits"] >= 1, moved
    assert hottest["moved_blocks"] >= prefix_blocks - 1, moved
    assert live.metric(other, "pdserve_node_moved_in_prefixes_total") == moved["prefixes_moved"]
    assert live.metric(other, "pdserve_node_moved_in_bytes_total") == moved["bytes_moved"]
    wait_for(
        "the index to learn the new holder", lambda: where(live, PREFIX).get(other, 0) >= prefix_blocks - 1
    )
    wait_for(f"{holder} to drain and leave the index", lambda: holder not in live_nodes(live))
    assert f"node {holder} draining: moved {moved['prefixes_moved']} prefixes" in live.log(holder)

    local = {"kind": "local"}
    hits_before = live.metric(other, "pdserve_node_prefix_hit_tokens_total", local)
    fetched_before = live.metric(other, "pdserve_node_fetched_blocks_total")
    third = complete(live, PREFIX + QUESTIONS[2])
    assert third["choices"][0]["text"] == cold[2]
    assert f"prefill {third['id']}-0:" in live.log(other)
    hit = live.metric(other, "pdserve_node_prefix_hit_tokens_total", local) - hits_before
    assert hit >= (prefix_blocks - 1) * BS, f"{hit} prompt tokens hit on {other}: the prefix was prefilled"
    assert live.metric(other, "pdserve_node_fetched_blocks_total") == fetched_before, "fetched, not moved"
    moved_hits = "pdserve_node_moved_prefix_hit_tokens_total"
    wanted = (prefix_blocks - 1) * BS
    wait_for("the moved-hit counter (a 1 s snapshot)", lambda: live.metric(other, moved_hits) >= wanted)
    live.wait_clean()

    # the only other prefill node left has a tiny pool: no room anywhere, so the drain is a plain one
    port = free_port()
    argv = cluster_fixture.node_argv(
        "prefill", TINY, port, live.redis_url, live.auth_token, *KV, "--num-kv-blocks", "8"
    )
    live.cluster.spawn(TINY, argv)
    live.nodes[TINY] = cluster_fixture.NodeProc(TINY, f"http://127.0.0.1:{port}")
    wait_for(f"{TINY} to register", lambda: TINY in live_nodes(live), timeout_s=300)
    plain = cluster_fixture.kvctl(live.redis_url, "drain", other, "--move-prefixes")["prefixes"]
    assert plain["prefixes_moved"] == 0 and plain["bytes_moved"] == 0, plain
    assert plain["chains"][0]["target"] == TINY and plain["chains"][0]["no_room"] is True, plain
    assert f"{TINY}: no room: 8 allocatable KV blocks here" in plain["degraded"], plain
    wait_for(f"{other} to drain and leave the index", lambda: other not in live_nodes(live))
    line = f"draining without moving its prefixes (a plain drain): {TINY}: no room"
    assert line in live.log(other)
    assert live.metric(TINY, "pdserve_node_moved_in_prefixes_total") == 0
    audits = live.wait_clean()
    assert all(a["in_use"] == 0 and a["reserved"] == 0 for a in audits.values()), audits
    print(f"\nmoved {moved['prefixes_moved']} prefix ({moved['bytes_moved']} bytes) {holder} -> {other}; "
          f"the next request hit {hit:.0f} tokens there; then: {plain['degraded']}")  # fmt: skip


def test_a_decode_node_drain_moves_its_prefix_to_the_other_decode_node(
    live_2d: cluster_fixture.LiveCluster, cold: list[str]
) -> None:
    """On D the prefix saves the transfer: the decode node the router picks next gets it, and the next
    request's KV transfer sends only the blocks past it (D's reservation holds the moved blocks)."""
    live = live_2d
    prefix_blocks = len(tokenize(cluster_fixture.model_path(), PREFIX, None)) // BS
    assert complete(live, PREFIX + QUESTIONS[0])["choices"][0]["text"] == cold[0]
    wait_for(
        "one decode node to hold the prefix", lambda: max(where(live, PREFIX).get(d, 0) for d in DECODE) > 0
    )
    holder = max(DECODE, key=lambda d: where(live, PREFIX).get(d, 0))
    other = next(d for d in DECODE if d != holder)
    assert complete(live, PREFIX + QUESTIONS[1])["choices"][0]["text"] == cold[1]  # D holds its prefix: a hit
    assert where(live, PREFIX).get(other, 0) == 0

    moved = cluster_fixture.kvctl(live.redis_url, "drain", holder, "--move-prefixes")["prefixes"]
    assert moved["degraded"] is None and moved["chains"][0]["target"] == other, moved
    assert moved["chains"][0]["moved_blocks"] >= prefix_blocks - 1, moved
    wait_for(
        "the index to learn the new holder", lambda: where(live, PREFIX).get(other, 0) >= prefix_blocks - 1
    )
    wait_for(f"{holder} to drain and leave the index", lambda: holder not in live_nodes(live))

    third = complete(live, PREFIX + QUESTIONS[2])
    assert third["choices"][0]["text"] == cold[2]
    moved_hits = "pdserve_node_moved_prefix_hit_tokens_total"
    wanted = (prefix_blocks - 1) * BS
    wait_for("the moved-hit counter on D", lambda: live.metric(other, moved_hits) >= wanted)
    live.wait_clean()


def test_kvctl_drain_help_names_move_prefixes() -> None:
    from pdserve.kvctl.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["drain", "--help"]) == 0
    assert "--move-prefixes" in out.getvalue() and "--budget-bytes" in out.getvalue()
