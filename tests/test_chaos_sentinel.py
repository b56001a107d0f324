"""Redis that fails over, through real processes: a primary, one replica and three sentinels
(tests/harness/sentinel_group.py); one prefill node, one decode node and a router (fleet admission, so its
leases live in Redis too) all given `--redis redis+sentinel://.../mymaster`. The primary is killed with -9
under streaming load: the streams in flight finish or fail cleanly (none hangs or is cut), a new request
succeeds within 10 s of the failover, the router and the nodes reach the new primary (the router's /health
says the index answers, its fleet ledger is not degraded), `kvctl diff` through the sentinels is clean
within a heartbeat (plus a step's slack) after the failover, and nothing is left running."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import httpx2
import pytest
from pdserve.tests.harness.chaos_faults import reference, wait_index_clean
from pdserve.tests.harness.chaos_load import Load, metric_of
from pdserve.tests.harness.cluster_fixture import LiveCluster, kvctl_main, served_model_name
from pdserve.tests.harness.sentinel_group import primary_port, redis_client, start_cluster

pytestmark = pytest.mark.slow

MODEL = served_model_name()
HEARTBEAT_S = 1.0
PROMPTS = [f"Name one thing that is {c}." for c in ("red", "blue", "green", "cold", "loud", "soft")]


@pytest.fixture(scope="module")
def live() -> Iterator[LiveCluster]:
    with start_cluster(router_extra=("--admission", "redis", "--max-requests-per-node", "8")) as cluster:
        yield cluster


def test_the_primary_dies_under_load_and_serving_and_the_index_carry_on(live: LiveCluster) -> None:
    want = reference(live, MODEL, PROMPTS, 12)
    load = Load(live.base, MODEL, PROMPTS, workers=4, max_tokens=12, timeout_s=120).start()
    load.wait_until(lambda outs: sum(o.kind == "ok" for o in outs) >= 4, 120)

    old = primary_port(live.redis_url)
    primary = next(r for r in live.cluster.redis if r.port == old)
    assert primary.pid is not None
    os.kill(primary.pid, signal.SIGKILL)
    primary.stop()  # reaps it
    killed = time.monotonic()
    while primary_port(live.redis_url) in (old, None):
        assert time.monotonic() - killed < 30, "the sentinels did not fail over in 30 s"
        time.sleep(0.1)
    failover = time.monotonic()
    print(f"sentinels named the replica primary {failover - killed:.1f}s after the kill")

    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}
    while True:
        reply = httpx2.post(f"{live.base}/v1/completions", json=body, timeout=60)
        if reply.status_code == 200:
            assert reply.json()["choices"][0]["text"] == want[PROMPTS[0]]
            break
        assert time.monotonic() - failover < 10, (
            f"no request succeeded within 10 s of the failover: {reply.text}"
        )
        time.sleep(0.2)
    print(f"first new request succeeded {time.monotonic() - failover:.1f}s after the failover")

    clean_s = wait_index_clean(live, failover, HEARTBEAT_S + 2.0)
    print(f"kvctl diff clean {clean_s:.1f}s after the failover")
    listed = {n["info"]["node_id"] for n in kvctl_main(live.redis_url, "nodes")["nodes"]}
    assert listed == set(live.nodes), listed

    deadline = time.monotonic() + 30  # the router's membership and its ledger's refresh run about every 1 s
    while not (
        httpx2.get(f"{live.base}/health", timeout=10).json().get("index") == "ok"
        and metric_of(live.base, "pdserve_router_admission_fleet_degraded") == 0
    ):
        assert time.monotonic() < deadline, "the router did not reach the new primary in 30 s"
        time.sleep(0.2)

    outcomes = load.stop()
    bad = [o for o in outcomes if o.kind not in ("ok", "error")]
    assert not bad, bad  # in flight at the kill: finished, or failed with an OpenAI error; never hung or cut
    wrong = [o for o in outcomes if o.kind == "ok" and o.text != want[o.prompt]]
    assert not wrong, wrong
    print(f"{len(outcomes)} streams: {sum(o.kind == 'ok' for o in outcomes)} ok, the rest failed cleanly")
    live.wait_clean()


def test_a_node_whose_last_registration_the_failover_lost_registers_again(live: LiveCluster) -> None:
    """Replication is asynchronous: a failover can lose a node's last registration, so the new primary holds
    an older epoch than the node's own. The node's writes are refused as stale; it must register again above
    its own epoch (as after Redis lost everything), not take the refusal as a newer process's."""
    node = "decode-0"
    (status,) = [n for n in kvctl_main(live.redis_url, "nodes")["nodes"] if n["info"]["node_id"] == node]
    epoch = int(status["info"]["epoch"])
    client = redis_client(live.redis_url)
    try:
        client.hset(f"pdserve:{{default}}:node:{node}", "epoch", str(epoch - 1))  # as the replica had it
    finally:
        client.close()
    deadline = time.monotonic() + 30
    while True:
        listed = {
            n["info"]["node_id"]: n["info"]["epoch"] for n in kvctl_main(live.redis_url, "nodes")["nodes"]
        }
        if listed.get(node, 0) > epoch:
            break
        assert time.monotonic() < deadline, f"{node} not listed again above epoch {epoch} in 30 s: {listed}"
        time.sleep(0.2)
    wait_index_clean(live, time.monotonic(), HEARTBEAT_S + 2.0)
