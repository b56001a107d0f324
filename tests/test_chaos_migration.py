"""Request migration (issues 20 and 39), on by default: kill -9 of a decode node mid-stream loses no
request: each stream it carried is re-prefilled on the other pair from its prompt and the tokens already
sent, and the client's stream goes on to the text an undisturbed run gives, greedy and seeded alike.
Real processes: redis-server, 1 P, 2 D, the router.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx2
import pytest
from pdserve.tests.harness.chaos_faults import SMALL_KV, kill9, reference
from pdserve.tests.harness.chaos_load import Load, metric_of
from pdserve.tests.harness.cluster_fixture import LiveCluster, sample, served_model_name, up_config

pytestmark = pytest.mark.slow

MODEL = served_model_name()
PROMPTS = [f"{w} are interesting because" for w in ("Apples", "Bridges", "Comets", "Deserts")]
MAX_TOKENS = 40
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}


def generated(live: LiveCluster, node: str) -> float:
    """Tokens the node has generated so far (counted as each step's output goes out), from its /metrics."""
    page = httpx2.get(f"{live.nodes[node].url}/metrics", timeout=10).text
    return sample(page, "pdserve_node_generation_tokens_total")


@pytest.fixture(scope="module")
def live() -> Iterator[LiveCluster]:
    cfg = up_config(prefill=1, decode=2, extra_node_args=SMALL_KV)  # the router's defaults: migration on
    with LiveCluster.start(cfg) as cluster:
        yield cluster


def test_streams_of_a_killed_decode_node_migrate_and_finish_with_the_undisturbed_text(
    live: LiveCluster,
) -> None:
    greedy = reference(live, MODEL, PROMPTS, MAX_TOKENS)
    seeded = reference(live, MODEL, PROMPTS, MAX_TOKENS, SEEDED)
    loads = [
        Load(live.base, MODEL, PROMPTS, 4, MAX_TOKENS, 90),
        Load(live.base, MODEL, PROMPTS, 4, MAX_TOKENS, 90, sampling=SEEDED),
    ]
    for load in loads:
        load.start()
    try:
        deadline = time.monotonic() + 120
        while metric_of(live.base, "pdserve_router_node_requests_in_flight", {"node_id": "decode-0"}) < 2:
            assert time.monotonic() < deadline, "decode-0 never carried two streams"
            time.sleep(0.02)
        loads[0].wait_until(lambda outs: any(len(o.events) >= 3 for o in outs if o.ended is None), 60)
        # the kill must find streams decoding on decode-0 (tokens sent): one still waiting for its KV there
        # is retried, not migrated
        before = generated(live, "decode-0")
        while generated(live, "decode-0") <= before:
            assert time.monotonic() < deadline, "no stream decoded on decode-0"
            time.sleep(0.01)
        killed_at = time.monotonic()
        kill9(live, "decode-0")
        time.sleep(8.0)
    finally:
        outcomes = [load.stop() for load in loads]
    failed = [(o.kind, o.error) for outs in outcomes for o in outs if o.kind != "ok"]
    assert not failed, f"requests failed although they could migrate: {failed[:3]}"
    for outs, want in zip(outcomes, (greedy, seeded), strict=True):
        wrong = [(o.response_id, o.prompt, o.text) for o in outs if o.text != want[o.prompt]]
        assert not wrong, f"another text than the undisturbed run: {wrong[:2]}"
    carried = [o for outs in outcomes for o in outs if o.active_at(killed_at) and len(o.events) >= 3]
    migrated = metric_of(live.base, "pdserve_router_aborts_total", {"reason": "migrated"})
    assert migrated >= 1, "no stream of the killed node migrated"
    total = sum(len(outs) for outs in outcomes)
    print(f"\n{migrated:.0f} streams migrated after kill -9 of decode-0 ({len(carried)} had tokens in "
          f"flight); all {total} requests completed with the undisturbed text")  # fmt: skip
    live.wait_clean()
