"""Prefix blocks held by another node are fetched over the KV-transfer protocol, not recomputed (issue 21),
through real processes (redis-server, two prefill nodes, one decode node, the router) on SmolLM2:

- a 2k-token prefix held on one prefill node only: a request placed on the other prefill node fetches it
  (node counters), computes only its suffix, and gives the greedy text of a cold run;
- a prefix only the decode node holds: through the router, a prefill node fetches it from D, D gets back
  only the blocks it lacks, and the router's "remote" hits count what was really fetched;
- churn: the holder evicts the prefix's last quarter between the lookup and the fetch; the fetch comes back
  short, the miss is counted, the prefill node computes the rest, and the text is still the cold run's.
Every scenario ends with clean audits on every node. The placements that must land on the node lacking the
prefix are made as the router makes them (its /internal/prefill + /internal/generate pair), since the router
rightly sends a prompt to the node holding its prefix.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest
from pdserve.kvctl.commands import tokenize
from pdserve.shared.engine.block_hash import hash_blocks, hash_seed
from pdserve.shared.engine.sampling_params import SamplingParams
from pdserve.shared.node.node_protocol import NodeGenerateRequest, PrefillRequest, PrefillResult, StepOutput
from pdserve.shared.node.node_sign import signed
from pdserve.shared.types import NodeId, RequestId
from pdserve.tests.harness import cluster_fixture

pytestmark = pytest.mark.slow

MODEL = cluster_fixture.served_model_name()
PREFILL = ("prefill-0", "prefill-1")
DECODE = "decode-0"
PREFIX = " ".join(
    f"Clause {i}: the tenant at flat {i} pays {i * 7} euros on day {i % 28 + 1} and keeps the garden tidy."
    for i in range(1, 72)
)
QUESTIONS = (" Question: who keeps the garden?", " Question: what does flat 3 pay?", " Summary:")
MAX_TOKENS = 8
BS = 16


@pytest.fixture(scope="module")
def live() -> Iterator[cluster_fixture.LiveCluster]:
    with cluster_fixture.LiveCluster.start(
        cluster_fixture.up_config(prefill=2, decode=1, extra_node_args=("--kv-cache-gib", "0.125"))
    ) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def cold() -> list[str]:
    """Greedy texts of `pdserve generate` for PREFIX + each question (one engine run)."""
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write("".join(json.dumps({"prompt": PREFIX + q}) + "\n" for q in QUESTIONS))
    try:
        lines = cluster_fixture.generate_offline_lines(
            "--prompts-file", f.name, "--max-tokens", str(MAX_TOKENS), "--kv-cache-gib", "0.125"
        )
    finally:
        os.unlink(f.name)
    return [line["text"] for line in lines]


def complete(live: cluster_fixture.LiveCluster, prompt: str) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx2.post(f"{live.base}/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    reply: dict[str, Any] = r.json()
    return reply


def prefill_line(live: cluster_fixture.LiveCluster, node: str, rid: str) -> tuple[int, int, int, int, int]:
    """(prompt tokens, cached, fetched, held on D, blocks sent) from the prefill node's log line."""
    pattern = re.compile(
        rf"prefill {re.escape(rid)}: (\d+) tokens, (\d+) cached here \((\d+) fetched\), (\d+) held on D, "
        r"(\d+) blocks sent"
    )
    m = pattern.search(live.log(node))
    assert m is not None, f"no prefill line for {rid} on {node}"
    a, b, c, d, e = (int(g) for g in m.groups())
    return a, b, c, d, e


def where(live: cluster_fixture.LiveCluster, prompt: str) -> dict[str, int]:
    rows = cluster_fixture.kvctl_main(live.redis_url, "where", "--prompt", prompt)["nodes"]
    return {r["node_id"]: r["prefix_blocks"] for r in rows}


def wait_where(
    live: cluster_fixture.LiveCluster, prompt: str, want: dict[str, int], timeout_s: float = 15.0
) -> None:
    """Waits until the index shows at least (or, for 0, exactly) `want` prefix blocks per node."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = where(live, prompt)
        if all(got.get(n, 0) >= b if b else got.get(n, 0) == 0 for n, b in want.items()):
            return
        assert time.monotonic() < deadline, f"kvctl where {got}, waited for {want}"
        time.sleep(0.2)


def evict(live: cluster_fixture.LiveCluster, node: str, hashes: list[bytes] | None) -> None:
    body: dict[str, Any] = {"all": True} if hashes is None else {"block_hashes": [h.hex() for h in hashes]}
    r = httpx2.post(f"{live.nodes[node].url}/internal/evict", json=body, auth=signed(live.auth_token))
    r.raise_for_status()


def placed_on(
    live: cluster_fixture.LiveCluster, node: str, prompt_ids: list[int], holder: str, blocks: int
) -> str:
    """Runs one request as the router would on (node, DECODE), naming `holder` as holding `blocks` prefix
    blocks; returns D's text."""
    statuses = {
        s["info"]["node_id"]: s["info"] for s in cluster_fixture.kvctl_main(live.redis_url, "nodes")["nodes"]
    }
    rid = RequestId(f"fetch-{uuid.uuid4().hex[:8]}")
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    deadline = time.time() + 600
    gen = NodeGenerateRequest(rid, tuple(prompt_ids), sampling, None, deadline, NodeId(node))
    pre = PrefillRequest(
        rid, tuple(prompt_ids), sampling, None, deadline, NodeId(DECODE), statuses[DECODE]["transfer_addr"],
        statuses[holder]["http_url"], blocks,
    )  # fmt: skip
    auth = signed(live.auth_token)
    steps: list[StepOutput] = []

    def stream() -> None:
        with httpx2.stream(
            "POST", f"{live.nodes[DECODE].url}/internal/generate", content=gen.to_json(), auth=auth,
            timeout=600,
        ) as r:  # fmt: skip
            for line in r.iter_lines():
                if line.strip():
                    steps.append(StepOutput.from_line(line))

    reader = threading.Thread(target=stream)
    reader.start()
    r = httpx2.post(f"{live.nodes[node].url}/internal/prefill", content=pre.to_json(), auth=auth, timeout=600)
    reader.join(600)
    result = PrefillResult.from_json(r.content)
    assert result.error is None, result.error
    assert steps and steps[-1].finish_reason == "length", steps[-1:]
    return "".join(s.text for s in steps)


def counters(live: cluster_fixture.LiveCluster, node: str) -> tuple[float, float, float]:
    return (
        live.metric(node, "pdserve_node_fetched_blocks_total"),
        live.metric(node, "pdserve_node_fetch_miss_blocks_total"),
        live.metric(node, "pdserve_node_exported_blocks_total"),
    )


def test_a_prefix_held_on_one_prefill_node_is_fetched_by_the_other(
    live: cluster_fixture.LiveCluster, cold: list[str]
) -> None:
    t0 = time.perf_counter()
    first = complete(live, PREFIX + QUESTIONS[0])
    cold_s = time.perf_counter() - t0
    assert first["choices"][0]["text"] == cold[0]
    holder = next(n for n in PREFILL if f"prefill {first['id']}-0:" in live.log(n))
    fetcher = next(n for n in PREFILL if n != holder)
    ids = tokenize(cluster_fixture.model_path(), PREFIX + QUESTIONS[1], None)
    prefix_blocks = len(tokenize(cluster_fixture.model_path(), PREFIX, None)) // BS
    evict(live, DECODE, None)  # the prefix stays on the holder only
    wait_where(live, PREFIX, {holder: prefix_blocks, DECODE: 0, fetcher: 0})
    before_f, before_h = counters(live, fetcher), counters(live, holder)

    t0 = time.perf_counter()
    text = placed_on(live, fetcher, ids, holder, prefix_blocks)
    fetch_s = time.perf_counter() - t0
    assert text == cold[1]
    after_f, after_h = counters(live, fetcher), counters(live, holder)
    fetched = after_f[0] - before_f[0]
    assert fetched >= prefix_blocks - 1, f"{fetched} of {prefix_blocks} prefix blocks fetched"
    assert after_f[1] == before_f[1], "no fetch miss"
    assert after_h[2] - before_h[2] == fetched, "the holder exported what the fetcher imported"
    print(f"\n2k-token prefix: cold request {cold_s:.2f}s; prefix fetched from {holder}: {fetch_s:.2f}s")
    live.wait_clean()


def test_a_prefix_only_d_holds_is_fetched_from_d_and_not_sent_back(
    live: cluster_fixture.LiveCluster, cold: list[str]
) -> None:
    prefix_blocks = len(tokenize(cluster_fixture.model_path(), PREFIX, None)) // BS
    wait_where(live, PREFIX, {DECODE: prefix_blocks})
    for node in PREFILL:
        evict(live, node, None)
    wait_where(live, PREFIX, {PREFILL[0]: 0, PREFILL[1]: 0, DECODE: prefix_blocks})
    router_before = httpx2.get(f"{live.base}/metrics").text
    exported_before = counters(live, DECODE)[2]
    fetched_before = sum(counters(live, n)[0] for n in PREFILL)

    reply = complete(live, PREFIX + QUESTIONS[2])
    assert reply["choices"][0]["text"] == cold[2]
    node = next(n for n in PREFILL if f"prefill {reply['id']}-0:" in live.log(n))
    total, cached, fetched, held_on_d, sent = prefill_line(live, node, f"{reply['id']}-0")
    assert fetched >= (prefix_blocks - 1) * BS and cached >= fetched
    assert held_on_d >= prefix_blocks - 1 and sent <= -(-total // BS) - held_on_d, "D's blocks not sent back"
    fetched_blocks = sum(counters(live, n)[0] for n in PREFILL) - fetched_before
    assert fetched_blocks * BS == fetched
    assert counters(live, DECODE)[2] - exported_before == fetched_blocks
    router = httpx2.get(f"{live.base}/metrics").text
    name = "pdserve_router_prefix_hit_tokens_total"
    remote = cluster_fixture.sample(router, name, {"kind": "remote"}) - cluster_fixture.sample(
        router_before, name, {"kind": "remote"}
    )
    assert remote == fetched, f"router counted {remote} remote tokens, the node fetched {fetched}"
    deadline = time.monotonic() + 10  # the index's hit statistics agree (the router records them aside)
    while (
        remote_stat := cluster_fixture.kvctl_main(live.redis_url, "stats")["nodes"][node]["remote_tokens"]
    ) < fetched:
        assert time.monotonic() < deadline, f"kvctl stats: {remote_stat} remote tokens on {node}"
        time.sleep(0.2)
    for kind in ("decisions_total", "actual_ttft_seconds_count", "estimated_ttft_seconds_count"):
        series = f"pdserve_router_cost_model_{kind}"
        fetch = {"option": "pd_fetch"}
        assert (
            cluster_fixture.sample(router, series, fetch)
            - cluster_fixture.sample(router_before, series, fetch)
            == 1
        ), series
    live.wait_clean()


def test_a_holder_that_evicted_part_of_the_prefix_makes_a_short_fetch(
    live: cluster_fixture.LiveCluster, cold: list[str]
) -> None:
    """Between the lookup (the index says the holder has every block) and the fetch, the holder evicts its
    last quarter: the fetch comes back short, the rest is computed, the text is the cold run's."""
    ids = tokenize(cluster_fixture.model_path(), PREFIX + QUESTIONS[0], None)
    prefix_blocks = len(tokenize(cluster_fixture.model_path(), PREFIX, None)) // BS
    holder = next((n for n in PREFILL if where(live, PREFIX).get(n, 0) >= prefix_blocks), None)
    if holder is None:  # the previous test's fetcher holds it now; make sure one P does
        complete(live, PREFIX + QUESTIONS[2])
        holder = max(PREFILL, key=lambda n: where(live, PREFIX).get(n, 0))
    fetcher = next(n for n in PREFILL if n != holder)
    evict(live, fetcher, None)
    evict(live, DECODE, None)
    wait_where(live, PREFIX, {holder: prefix_blocks, fetcher: 0, DECODE: 0})
    info = cluster_fixture.kvctl_main(live.redis_url, "nodes")["nodes"][0]["info"]
    hashes = hash_blocks(ids, BS, hash_seed(bytes.fromhex(info["model_fingerprint"]), None))
    keep = 3 * prefix_blocks // 4  # the computed rest stays small: the CPU test stays short
    before = counters(live, fetcher)
    evict(live, holder, list(hashes[keep:prefix_blocks]))  # the index still says the holder has them all

    text = placed_on(live, fetcher, ids, holder, prefix_blocks)
    assert text == cold[0]
    after = counters(live, fetcher)
    assert after[0] - before[0] == keep, f"fetched {after[0] - before[0]}, the holder kept {keep}"
    assert after[1] - before[1] == min(prefix_blocks, (len(ids) - 1) // BS) - keep, "the miss is counted"
    live.wait_clean()


def test_the_decode_node_fetches_a_prefix_and_computes_the_rest_itself(
    live: cluster_fixture.LiveCluster, cold: list[str]
) -> None:
    """The cost model's local_fetch, as the router sends it: D is told a prefill node holds the prefix, pulls
    it over the KV-transfer protocol into its own pool and computes only the suffix; no prefill node
    computes anything, and the text is the cold run's."""
    ids = tokenize(cluster_fixture.model_path(), PREFIX + QUESTIONS[1], None)
    prefix_blocks = len(tokenize(cluster_fixture.model_path(), PREFIX, None)) // BS
    holder = max(PREFILL, key=lambda n: where(live, PREFIX).get(n, 0))
    if where(live, PREFIX).get(holder, 0) < prefix_blocks:
        complete(live, PREFIX + QUESTIONS[2])
        holder = max(PREFILL, key=lambda n: where(live, PREFIX).get(n, 0))
    evict(live, DECODE, None)
    wait_where(live, PREFIX, {holder: prefix_blocks, DECODE: 0})
    statuses = {
        s["info"]["node_id"]: s["info"] for s in cluster_fixture.kvctl_main(live.redis_url, "nodes")["nodes"]
    }
    before_d, before_h = counters(live, DECODE), counters(live, holder)
    rid = RequestId(f"local-fetch-{uuid.uuid4().hex[:8]}")
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    gen = NodeGenerateRequest(
        rid, tuple(ids), sampling, None, time.time() + 600, None, statuses[holder]["http_url"], prefix_blocks
    )
    steps: list[StepOutput] = []
    with httpx2.stream(
        "POST", f"{live.nodes[DECODE].url}/internal/generate", content=gen.to_json(),
        auth=signed(live.auth_token), timeout=600,
    ) as r:  # fmt: skip
        assert r.status_code == 200
        steps += [StepOutput.from_line(line) for line in r.iter_lines() if line.strip()]
    assert steps and steps[-1].finish_reason == "length", steps[-1:]
    assert "".join(s.text for s in steps) == cold[1]
    after_d, after_h = counters(live, DECODE), counters(live, holder)
    fetched = after_d[0] - before_d[0]
    assert fetched >= prefix_blocks - 1, f"D fetched {fetched} of {prefix_blocks} prefix blocks"
    assert after_d[1] == before_d[1], "no fetch miss"
    assert after_h[2] - before_h[2] == fetched, "the holder exported what D imported"
    assert steps[0].cached_tokens >= fetched * BS, "D computed only what it did not fetch"
    with pytest.raises(ValueError, match="no prefill_node_id"):
        NodeGenerateRequest(rid, tuple(ids), sampling, None, time.time() + 60, NodeId(holder), "http://x", 1)
    live.wait_clean()
