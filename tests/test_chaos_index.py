"""The index tells the truth (issue 20): records that disagree with what a node holds (a lost Removed event
leaves stale records, a lost Stored event leaves held blocks unlisted) show in `kvctl diff`, in the router's
staleness gauge (indexed minus held, per node), and in the count of routing decisions made on stale records;
`kvctl diff --repair` fixes them at once, and the nodes' own heartbeat digest fixes them unasked. Real
processes: redis-server, 1 P, 1 D, the router; the lies are written into Redis as a lost event would leave it.
"""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest
from pdserve.kvctl.commands import prompt_hashes, tokenize
from pdserve.shared.engine.block_pool import BlockEvent, BlockRemoved, BlockStored
from pdserve.shared.index.block_digest import MISMATCHES_TO_COMPARE, SETTLE_S
from pdserve.shared.index.block_index import BlockIndex
from pdserve.shared.index.block_index_types import RedisConfig
from pdserve.shared.node.node_sign import ClusterKeys
from pdserve.shared.types import BlockHash, NodeId
from pdserve.tests.harness.chaos_faults import small_cluster
from pdserve.tests.harness.chaos_load import metric_of
from pdserve.tests.harness.cluster_fixture import LiveCluster, kvctl_main, secret_file, served_model_name

pytestmark = pytest.mark.slow

MODEL = served_model_name()
HEARTBEAT_S = 1.0
PROMPT = " ".join(f"Rule {i}: keep the gate at number {i} shut after dark." for i in range(1, 9))


@pytest.fixture(scope="module")
def live() -> Iterator[LiveCluster]:
    with small_cluster(prefill=1, decode=1) as cluster:
        for i in range(3):
            complete(live=cluster, prompt=f"{PROMPT} Question {i}: which gate stays shut?")
        yield cluster


def complete(live: LiveCluster, prompt: str) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    r = httpx2.post(f"{live.base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    reply: dict[str, Any] = r.json()
    return reply


def diff(live: LiveCluster, *args: str) -> dict[str, Any]:
    return kvctl_main(live.redis_url, "diff", *args)


def epoch(live: LiveCluster, node: str) -> int:
    nodes = {n["info"]["node_id"]: n["info"]["epoch"] for n in kvctl_main(live.redis_url, "nodes")["nodes"]}
    return int(nodes[node])


def lie(live: LiveCluster, node: str, events: list[BlockEvent]) -> None:
    """Writes events into the node's records as if the node had published them."""

    current = epoch(live, node)

    async def go() -> None:
        async with BlockIndex(RedisConfig(url=live.redis_url), ClusterKeys(live.auth_token)) as index:
            await index.publish(NodeId(node), current, events)

    asyncio.run(go())


def fake_hashes(n: int, tag: str) -> tuple[BlockHash, ...]:
    return tuple(BlockHash(hashlib.sha256(f"{tag}-{i}".encode()).digest()) for i in range(n))


def held_records(live: LiveCluster, node: str, limit: int) -> tuple[BlockHash, ...]:
    found = kvctl_main(live.redis_url, "blocks", "--node", node, "--limit", str(limit))["nodes"][node]
    return tuple(BlockHash(bytes.fromhex(h)) for h in found["hashes"])


def test_diff_is_clean_on_an_undisturbed_cluster(live: LiveCluster) -> None:
    report = diff(live)
    assert report["clean"], report
    rows = report["nodes"]
    assert set(rows) == set(live.nodes)
    assert all(r["held"] == r["indexed"] > 0 for r in rows.values()), rows


def test_stale_records_show_everywhere_and_repair_fixes_them(live: LiveCluster) -> None:
    gone = fake_hashes(5, "evicted")
    dropped = held_records(live, "decode-0", 3)
    lie(live, "prefill-0", [BlockStored(gone, None)])
    lie(live, "decode-0", [BlockRemoved(dropped)])

    report = diff(live)  # within a heartbeat of the lies: the nodes' digests have not repaired them yet
    assert not report["clean"]
    p, d = report["nodes"]["prefill-0"], report["nodes"]["decode-0"]
    assert (p["extra"], p["missing"], d["extra"], d["missing"]) == (5, 0, 0, 3), report
    assert set(p["extra_hashes"]) == {h.hex() for h in gone}
    assert set(d["missing_hashes"]) == {h.hex() for h in dropped}
    deadline = time.monotonic() + 3 * HEARTBEAT_S
    while metric_of(live.base, "pdserve_router_index_stale_blocks", {"node_id": "prefill-0"}) != 5:
        assert time.monotonic() < deadline, "the router's staleness gauge did not show the 5 stale records"
        time.sleep(0.05)

    repaired = diff(live, "--repair")
    assert repaired["repair"] and all(r["repaired"] for r in repaired["nodes"].values()), repaired
    assert diff(live)["clean"]
    # Whoever got there first (this repair or the nodes' own digest), every lie was undone.
    assert live.metric("prefill-0", "pdserve_node_index_repaired_blocks_total", {"kind": "extra"}) >= 5
    assert live.metric("decode-0", "pdserve_node_index_repaired_blocks_total", {"kind": "missing"}) >= 3


def test_decisions_on_stale_records_are_counted(live: LiveCluster) -> None:
    # A prompt the prefill node has never seen, whose first blocks the index now says it holds.
    tokens = tokenize(None, "Tell me a long story about the sea. " * 8, None)

    async def hashes() -> list[BlockHash]:
        async with BlockIndex(RedisConfig(url=live.redis_url), ClusterKeys(live.auth_token)) as index:
            return (await prompt_hashes(index, tokens, None))[1]

    unseen = asyncio.run(hashes())
    assert len(unseen) >= 4
    labels = {"node_id": "prefill-0"}
    before = metric_of(live.base, "pdserve_router_stale_decisions_total", labels)
    lie(live, "prefill-0", [BlockStored(tuple(unseen[:4]), None)])
    time.sleep(0.1)
    body = {"model": MODEL, "prompt": tokens, "max_tokens": 2, "temperature": 0}
    assert httpx2.post(f"{live.base}/v1/completions", json=body, timeout=120).status_code == 200
    assert metric_of(live.base, "pdserve_router_stale_decisions_total", labels) == before + 1
    live.wait_clean()


def test_heartbeat_digest_repairs_unasked(live: LiveCluster) -> None:
    lie(live, "prefill-0", [BlockStored(fake_hashes(7, "unasked"), None)])
    dropped = held_records(live, "decode-0", 2)
    lie(live, "decode-0", [BlockRemoved(dropped)])
    hurt_at = time.monotonic()
    budget = (MISMATCHES_TO_COMPARE + 2) * HEARTBEAT_S + SETTLE_S
    while not diff(live)["clean"]:
        assert time.monotonic() - hurt_at < budget + 5, f"not repaired {budget + 5:.1f} s after the lie"
        time.sleep(0.2)
    took = time.monotonic() - hurt_at
    print(f"\nthe nodes' digests repaired 7 stale and 2 missing records {took:.1f} s after they appeared")
    assert live.metric("decode-0", "pdserve_node_index_digest_checks_total", {"result": "match"}) > 0


def test_kvctl_diff_prints_a_table(live: LiveCluster) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.kvctl.cli", "diff", "--redis", live.redis_url,
         "--auth-token-file", secret_file(live.auth_token)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["NODE", "EPOCH", "HELD", "INDEXED", "EXTRA", "MISSING", "STATE"]
    assert {line.split()[0] for line in lines[1:]} == set(live.nodes)
    assert all(line.split()[-1] == "ok" for line in lines[1:])
