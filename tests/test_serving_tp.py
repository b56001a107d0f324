"""Prefill and decode nodes of different tensor-parallel sizes, through real processes, the router and the
real SmolLM2 weights on the CPU (gloo): P TP=1 -> D TP=3 and P TP=3 -> D TP=1 give `pdserve generate`'s
greedy text, for a fresh prompt, for a second prompt sharing its long prefix (D holds it), after D's cache
is evicted (P sends the prefix it holds), and after P's is (P fetches the prefix from D); `kvctl nodes`
and /metrics state each node's size and devices; a node whose KV layout differs is refused at registration
in one line naming both layouts; and `kill -9` of one worker rank under load takes its node out of the
cluster (the other ranks and the node process exit, the index drops it at once), every request in flight
ends with a clean error or the right text, and no process is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx2
import pytest
from pdserve.cli.up import free_port
from pdserve.tests.harness import cluster_fixture
from pdserve.tests.harness.chaos_faults import SMALL_KV

pytestmark = pytest.mark.slow

MODEL = cluster_fixture.served_model_name()
DOCUMENT = " ".join(
    f"Clause {i} of the contract sets the fee for month {i} at {3 * i} euros." for i in range(16)
)
PROMPTS = [DOCUMENT + " Summary:", DOCUMENT + " The fee for month 5 is", "The three primary colors are"]
MAX_TOKENS = 12
SIZES = {"p1-d3": ("1", "3"), "p3-d1": ("3", "1")}
"""(prefill TP, decode TP) of each cluster."""


@pytest.fixture(scope="module")
def want() -> list[str]:
    return cluster_fixture.reference_texts([{"prompt": p} for p in PROMPTS], MAX_TOKENS)


@pytest.fixture(scope="module", params=list(SIZES.values()), ids=list(SIZES))
def live(request: pytest.FixtureRequest) -> Iterator[cluster_fixture.LiveCluster]:
    p_tp, d_tp = request.param
    cfg = cluster_fixture.up_config(
        prefill=1,
        decode=1,
        extra_node_args=SMALL_KV,
        role_node_args=(("prefill", ("-tp", p_tp)), ("decode", ("-tp", d_tp))),
    )
    with cluster_fixture.LiveCluster.start(cfg) as cluster:
        yield cluster


def complete(live: cluster_fixture.LiveCluster, prompt: str, max_tokens: int = MAX_TOKENS) -> httpx2.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx2.post(f"{live.base}/v1/completions", json=body, timeout=300)


def text(live: cluster_fixture.LiveCluster, prompt: str) -> str:
    reply = complete(live, prompt)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["text"])


def tp_sizes(live: cluster_fixture.LiveCluster) -> dict[str, tuple[int, list[str]]]:
    nodes = cluster_fixture.kvctl_main(live.redis_url, "nodes")["nodes"]
    return {n["info"]["node_id"]: (n["info"]["kv_layout"]["tp_size"], n["info"]["devices"]) for n in nodes}


def test_greedy_text_across_tp_sizes_with_and_without_a_held_prefix(
    live: cluster_fixture.LiveCluster, want: list[str]
) -> None:
    sizes = tp_sizes(live)
    p_tp, d_tp = sizes["prefill-0"][0], sizes["decode-0"][0]
    assert sorted((p_tp, d_tp)) == [1, 3] and sizes["decode-0"][1] == ["cpu"] * d_tp
    metrics = httpx2.get(f"{live.nodes['decode-0'].url}/metrics", timeout=10).text
    assert (
        f'pdserve_node_info{{devices="{",".join(["cpu"] * d_tp)}",role="decode",tp_size="{d_tp}"}} 1.0'
        in metrics
    )
    assert [text(live, p) for p in PROMPTS] == want  # the second shares the first's 16 blocks, held on D
    assert live.metric("decode-0", "pdserve_node_prefix_hit_tokens_total", {"kind": "local"}) >= 16 * 16
    cluster_fixture.kvctl_main(
        live.redis_url, "evict", "--node", "decode-0", "--all"
    )  # P holds the prefix, D no longer
    assert text(live, PROMPTS[1]) == want[1]
    live.wait_clean()


def test_a_prefix_only_d_holds_is_fetched_across_tp_sizes(
    live: cluster_fixture.LiveCluster, want: list[str]
) -> None:
    """P (one size) fetches the prefix from D (the other size): D exports every rank's heads, P imports them
    onto its ranks (node/kv_fetch.py over the same remote-KV port)."""
    for _ in range(150):  # D's blocks reach the index in the node's next publish batch
        rows = cluster_fixture.kvctl_main(live.redis_url, "where", "--prompt", DOCUMENT)["nodes"]
        if {r["node_id"]: r["prefix_blocks"] for r in rows}.get("decode-0", 0) >= 16:
            break
        time.sleep(0.2)
    cluster_fixture.kvctl_main(live.redis_url, "evict", "--node", "prefill-0", "--all")
    fetched = live.metric("prefill-0", "pdserve_node_fetched_blocks_total")
    exported = live.metric("decode-0", "pdserve_node_exported_blocks_total")
    assert text(live, PROMPTS[0]) == want[0]
    got = live.metric("prefill-0", "pdserve_node_fetched_blocks_total") - fetched
    assert got >= 16 and live.metric("decode-0", "pdserve_node_exported_blocks_total") - exported == got
    live.wait_clean()


def test_a_node_whose_kv_layout_differs_is_refused_in_one_line(live: cluster_fixture.LiveCluster) -> None:
    argv = cluster_fixture.node_argv(
        "decode", "decode-odd", free_port(), live.redis_url, live.auth_token, *SMALL_KV, "--block-size", "32"
    )
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("pdserve: error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert "kv_layout.block_size is 32 on the node but 16" in errors[0]
    assert "(node: 30 layers x 3 KV heads x 64, block 32, " in errors[0], errors[0]
    assert "; live nodes: 30 layers x 3 KV heads x 64, block 16, " in errors[0], errors[0]


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] == "Z"


def test_killing_one_worker_rank_under_load_takes_its_node_out(
    live: cluster_fixture.LiveCluster, want: list[str]
) -> None:
    """The last test of each cluster: it leaves the TP=3 node dead."""
    name = next(n for n, (tp, _) in tp_sizes(live).items() if tp == 3)
    node = next(p for n, p in live.cluster.procs if n == name)
    workers = _children(node.pid)
    assert len(workers) == 2, workers
    with ThreadPoolExecutor(max_workers=6) as pool:
        replies = [pool.submit(complete, live, p, 48) for p in PROMPTS * 2]
        time.sleep(2.0)  # requests are in flight on both nodes
        os.kill(workers[0], signal.SIGKILL)
        killed = time.monotonic()
        while not _gone(workers[1]) and time.monotonic() - killed < 30:
            time.sleep(0.02)
        others_gone = time.monotonic() - killed
        while name in tp_sizes(live) and time.monotonic() - killed < 30:
            time.sleep(0.05)
        deregistered = time.monotonic() - killed
        node.wait(30)
        exited = time.monotonic() - killed
        print(f"rank kill: others gone {others_gone:.2f}s, unlisted {deregistered:.2f}s, exit {exited:.2f}s")
        assert others_gone < 5.0, f"the other ranks took {others_gone:.1f}s"
        assert deregistered < 5.0, f"the node stayed in the index for {deregistered:.1f}s"
        assert node.returncode != 0
        results = [r.result() for r in replies]
    live.nodes.pop(name)
    for i, reply in enumerate(results):  # each ended: the right text (finished, migrated) or a clean error
        if reply.status_code == 200:
            assert reply.json()["choices"][0]["text"].startswith(want[i % len(PROMPTS)]), reply.text
        else:
            assert reply.status_code >= 400, reply.text
            assert reply.json()["error"]["message"], reply.text
    assert not [pid for pid in workers if not _gone(pid)]
