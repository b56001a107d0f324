"""A fleet of three routers over one Redis (`--admission redis`), `--max-requests-per-node 4`, one prefill
and one decode node, real processes: 60 concurrent streams spread over the routers never put more than 4
requests on a node (the nodes' own running + waiting gauges, sampled through the run, and the leases in
Redis), every stream ends with its greedy text or a 429 before streaming; one router killed with -9 mid-run
loses its leases within the lease TTL (3 s) and the other two go on. The wait each router's clients saw
(time to the first token) is printed per router: the fairness across routers, measured, not asserted."""

from __future__ import annotations

import os
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from typing import cast

import httpx2
import pytest
import redis
from pdserve.cli.up import free_port
from pdserve.tests.harness import cluster_fixture
from pdserve.tests.harness.chaos_faults import SMALL_KV, start_router
from pdserve.tests.harness.chaos_load import Outcome, send

pytestmark = pytest.mark.slow

MODEL = cluster_fixture.served_model_name()
CAP = 4
MAX_TOKENS = 12
LEASE_TTL_S = 3.0
FLEET = ("--admission", "redis", "--max-requests-per-node", str(CAP))
PROMPTS = [f"Write one short sentence about the number {i}." for i in range(20)]


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[cluster_fixture.LiveCluster, list[str]]]:
    with cluster_fixture.LiveCluster.start(
        cluster_fixture.up_config(prefill=1, decode=1, extra_node_args=SMALL_KV, router_args=FLEET)
    ) as live:
        bases = [live.base] + [start_router(live, f"router-{i}", free_port(), *FLEET) for i in (2, 3)]
        yield live, bases


class Sampler:
    """Samples every node's running + waiting gauges and the leases Redis holds per node until stopped."""

    def __init__(self, live: cluster_fixture.LiveCluster) -> None:
        self.live = live
        self.node_max: dict[str, float] = {}
        self.lease_max: dict[str, int] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._redis = redis.Redis.from_url(live.redis_url)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        self._redis.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, node in list(self.live.nodes.items()):
                text = httpx2.get(f"{node.url}/metrics", timeout=10).text
                held = cluster_fixture.sample(text, "pdserve_node_running_requests") + cluster_fixture.sample(
                    text, "pdserve_node_waiting_requests"
                )
                self.node_max[name] = max(self.node_max.get(name, 0.0), held)
                self.lease_max[name] = max(self.lease_max.get(name, 0), len(live_leases(self._redis, name)))
            self.samples += 1
            self._stop.wait(0.1)


def live_leases(client: redis.Redis, node: str) -> list[str]:
    """The lease ids Redis holds for `node` that have not expired (Redis's clock)."""
    seconds, micros = client.time()
    now_ms = seconds * 1000 + micros // 1000
    members = cast(list[bytes], client.zrangebyscore(f"pdserve:{{default}}:lease:{node}", now_ms, "+inf"))
    return [m.decode() for m in members]


def test_three_routers_hold_the_cap_for_the_fleet_and_a_killed_routers_leases_expire(
    fleet: tuple[cluster_fixture.LiveCluster, list[str]],
) -> None:
    live, bases = fleet
    want = dict(
        zip(
            PROMPTS,
            cluster_fixture.reference_texts([{"prompt": p} for p in PROMPTS], MAX_TOKENS),
            strict=True,
        )
    )
    outcomes: list[tuple[int, Outcome]] = []
    client = httpx2.Client(timeout=300)

    def stream(i: int) -> None:
        prompt = PROMPTS[i % len(PROMPTS)]
        out = Outcome(prompt, time.monotonic())
        outcomes.append((i % 3, out))
        body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
        send(client, bases[i % 3], body, out, 0)

    router3 = next(p for n, p in live.cluster.procs if n == "router-3")
    redis_client = redis.Redis.from_url(live.redis_url)
    with Sampler(live) as sampler:
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(60)]
        for thread in threads:
            thread.start()
        # kill router-3 while it holds leases (its requests run or wait)
        deadline = time.monotonic() + 300
        while not any(f".{router3.pid}." in lease for lease in live_leases(redis_client, "decode-0")):
            assert time.monotonic() < deadline, "router-3 never held a lease on decode-0"
            time.sleep(0.05)
        seconds, micros = cast(tuple[int, int], redis_client.time())
        os.killpg(router3.pid, signal.SIGKILL)
        router3.wait(10)
        live.cluster.procs.remove(("router-3", router3))
        killed_ms = seconds * 1000 + micros // 1000
        # every lease it held expires at most one lease TTL after its death (it refreshed them last then)
        key = "pdserve:{default}:lease:decode-0"
        scored = cast(list[tuple[bytes, float]], redis_client.zrange(key, 0, -1, withscores=True))
        theirs = [(m, s) for m, s in scored if f".{router3.pid}.".encode() in m]
        assert all(score <= killed_ms + LEASE_TTL_S * 1000 + 50 for _, score in theirs), (killed_ms, theirs)
        gone_after = time.monotonic()
        while any(f".{router3.pid}." in lease for lease in live_leases(redis_client, "decode-0")):
            time.sleep(0.05)
        print(f"router-3's {len(theirs)} leases freed {time.monotonic() - gone_after:.2f}s after its kill -9")
        for thread in threads:
            thread.join(600)
    redis_client.close()
    client.close()

    print(
        f"{sampler.samples} samples; most running+waiting per node {sampler.node_max}, "
        f"most leases {sampler.lease_max}"
    )
    assert sampler.samples >= 5
    assert all(held <= CAP for held in sampler.node_max.values()), sampler.node_max
    assert all(held <= CAP for held in sampler.lease_max.values()), sampler.lease_max
    for router, out in outcomes:
        if router == 2:  # the killed router's clients: cut or refused, nothing to check but a clean end
            continue
        if out.kind == "error":
            assert out.status == 429 and not out.events, out  # refused before streaming
        else:
            assert out.kind == "ok" and out.text == want[out.prompt], (router, out)
    for router in (0, 1):
        waits = sorted(out.events[0] - out.started for r, out in outcomes if r == router and out.events)
        q = statistics.quantiles(waits, n=10)
        print(
            f"router-{router + 1}: {len(waits)} streams, first event after p50 {q[4]:.2f}s "
            f"p90 {q[8]:.2f}s max {waits[-1]:.2f}s"
        )
    live.wait_clean()
    check = redis.Redis.from_url(live.redis_url)
    assert not live_leases(check, "decode-0") and not live_leases(check, "prefill-0")
    check.close()
