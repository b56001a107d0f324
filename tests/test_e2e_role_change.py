"""End to end: `kvctl role` moves a node between roles at run time (two prefill nodes and one decode node).
The prefill node holding a shared prompt prefix becomes a decode node: streams sent across the change all
complete with their greedy text; it re-registers under the new role with a new epoch, keeps its prefix
cache, and the next requests with that prefix hit it there (its local prefix-hit counter and the response's
cached tokens) with the greedy reference text. Emptying a role is refused without --force, and a bad role
name is refused, each with one line and a non-zero exit. A node's metrics count the change and name its
current role. Then, with --migrate, the same node goes back to prefill while it decodes: its streams move to
the other decode node (the router's migration) and finish with their greedy text.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx2
import openai
import pytest
from pdserve.tests.harness import cluster_fixture

pytestmark = pytest.mark.slow

MODEL = cluster_fixture.served_model_name()
PREFIX = " ".join(
    f"Rule {i}: the keeper of lighthouse number {i} lights the lamp at dusk and logs the ships on day {i}."
    for i in range(1, 15)
)
QUESTIONS = (
    " Question: when is the lamp lit?",
    " Question: what does the keeper log?",
    " Question: which lighthouse is first?",
    " Question: who keeps the lighthouse?",
    " Question: what happens on day 3?",
)
MAX_TOKENS = 12
MIGRATE_TOKENS = 160
"""Long enough that the streams still decode when the node gets the change (kvctl starts in ~1-2 s)."""


@pytest.fixture(scope="module")
def live() -> Iterator[cluster_fixture.LiveCluster]:
    yield from cluster_fixture.live_cluster(prefill=2, decode=1)


@pytest.fixture(scope="module")
def client(live: cluster_fixture.LiveCluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{live.base}/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    prompts = [PREFIX + q for q in QUESTIONS]
    return dict(
        zip(
            prompts,
            cluster_fixture.reference_texts([{"prompt": p} for p in prompts], MAX_TOKENS),
            strict=True,
        )
    )


def kvctl_fails(live: cluster_fixture.LiveCluster, *args: str) -> str:
    """Runs kvctl expecting a failure; returns its one line of stderr."""
    done = cluster_fixture.run_cli(
        "pdserve.kvctl.cli",
        *args,
        "--redis",
        live.redis_url,
        "--auth-token-file",
        cluster_fixture.secret_file(live.auth_token),
    )
    assert done.returncode != 0, f"kvctl {args} succeeded: {done.stdout}"
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, f"kvctl {args}: not one line: {done.stderr}"
    return lines[0]


def nodes(live: cluster_fixture.LiveCluster) -> dict[str, dict[str, Any]]:
    return {n["info"]["node_id"]: n for n in cluster_fixture.kvctl(live.redis_url, "nodes")["nodes"]}


def stream(
    client: openai.OpenAI, prompt: str, max_tokens: int, out: dict[str, str], errors: list[str]
) -> None:
    try:
        chunks = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
        )
        out[prompt] = "".join(c.choices[0].text for c in chunks if c.choices)
    except Exception as exc:  # the test asserts none happened
        errors.append(f"{prompt[-30:]!r}: {exc!r}")


def streams_across(
    client: openai.OpenAI, prompts: list[str], change: Any, max_tokens: int = MAX_TOKENS
) -> dict[str, str]:
    """Starts one stream per prompt, runs `change()` while they run, and returns their texts (asserting
    that none failed)."""
    out: dict[str, str] = {}
    errors: list[str] = []
    args = [(client, p, max_tokens, out, errors) for p in prompts]
    threads = [threading.Thread(target=stream, args=a) for a in args]
    for t in threads:
        t.start()
    time.sleep(0.5)
    change()
    for t in threads:
        t.join(timeout=300)
    assert not errors, f"requests failed across the role change: {errors}"
    return out


def router_migrations(live: cluster_fixture.LiveCluster) -> float:
    text = httpx2.get(f"{live.base}/metrics", timeout=10).text
    return cluster_fixture.sample(text, "pdserve_router_aborts_total", {"reason": "migrated"})


def holder_of_prefix(live: cluster_fixture.LiveCluster) -> str:
    deadline = time.monotonic() + 10
    while True:
        where = {
            r["node_id"]: r["prefix_blocks"]
            for r in cluster_fixture.kvctl(live.redis_url, "where", "--prompt", PREFIX)["nodes"]
        }
        holders = [n for n in ("prefill-0", "prefill-1") if where.get(n, 0) >= 16]
        if holders or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(holders) == 1, f"kvctl where: {where}"
    return holders[0]


def test_emptying_a_role_is_refused(live: cluster_fixture.LiveCluster) -> None:
    line = kvctl_fails(live, "role", "decode-0", "prefill")
    assert "decode-0" in line and "--force" in line, line
    assert nodes(live)["decode-0"]["info"]["role"] == "decode"


def test_a_bad_role_name_is_refused(live: cluster_fixture.LiveCluster) -> None:
    line = kvctl_fails(live, "role", "prefill-0", "router")
    assert "router" in line and "prefill" in line and "decode" in line and "single" in line, line


def test_a_prefix_holder_changes_role_and_keeps_its_cache(
    live: cluster_fixture.LiveCluster, client: openai.OpenAI, reference: dict[str, str]
) -> None:
    prompts = list(reference)
    first = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=MAX_TOKENS, temperature=0)
    assert first.choices[0].text == reference[prompts[0]]
    holder = holder_of_prefix(live)
    before = nodes(live)[holder]
    assert before["info"]["role"] == "prefill"

    replies: list[dict[str, Any]] = []
    texts = streams_across(
        client,
        prompts[1:3],
        lambda: replies.append(cluster_fixture.kvctl(live.redis_url, "role", holder, "decode")),
    )
    assert texts == {p: reference[p] for p in prompts[1:3]}
    assert replies[0]["role"] == "decode" and replies[0]["from_role"] == "prefill", replies
    after = nodes(live)[holder]
    assert after["info"]["role"] == "decode" and after["info"]["epoch"] > before["info"]["epoch"], after
    assert not after["draining"]
    where = {
        r["node_id"]: r for r in cluster_fixture.kvctl(live.redis_url, "where", "--prompt", PREFIX)["nodes"]
    }
    assert where[holder]["prefix_blocks"] >= 16 and where[holder]["role"] == "decode", where

    # decode-0 took the prefix's KV from P, and the streams above put it on the other prefill node too:
    # evicted there, the changed node is the only holder left, so a hit can only be its kept cache
    others = [n for n in live.nodes if n != holder]
    for node in others:
        cluster_fixture.kvctl(live.redis_url, "evict", "--node", node, "--prompt", PREFIX)
    deadline = time.monotonic() + 10
    while any(where[n]["prefix_blocks"] for n in others) and time.monotonic() < deadline:
        time.sleep(0.2)
        where = {
            r["node_id"]: r
            for r in cluster_fixture.kvctl(live.redis_url, "where", "--prompt", PREFIX)["nodes"]
        }
    assert not any(where[n]["prefix_blocks"] for n in others), where
    hits_before = live.metric(holder, "pdserve_node_prefix_hit_tokens_total", {"kind": "local"})
    reply = client.completions.create(model=MODEL, prompt=prompts[3], max_tokens=MAX_TOKENS, temperature=0)
    assert reply.choices[0].text == reference[prompts[3]]
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    assert (reply.usage.prompt_tokens_details.cached_tokens or 0) >= 256, reply.usage
    hits = live.metric(holder, "pdserve_node_prefix_hit_tokens_total", {"kind": "local"}) - hits_before
    assert hits >= 256, f"{holder} served {hits} prompt tokens from its cache in its new role"
    changes = {"from_role": "prefill", "to_role": "decode"}
    assert live.metric(holder, "pdserve_node_role_changes_total", changes) == 1
    assert live.metric(holder, "pdserve_node_info", {"role": "decode"}) == 1
    assert live.metric(holder, "pdserve_node_info", {"role": "prefill"}) == 0
    live.wait_clean()


def test_migrate_moves_its_decodes_to_the_other_decode_node(
    live: cluster_fixture.LiveCluster, client: openai.OpenAI
) -> None:
    """After the test above two nodes decode; the changed one goes back to prefill with --migrate while
    long streams decode on it: they finish elsewhere (the router migrates them) with their greedy text."""
    changed = next(
        n for n, s in nodes(live).items() if n.startswith("prefill") and s["info"]["role"] == "decode"
    )
    prompts = [PREFIX + q for q in QUESTIONS[2:5]]
    want = dict(
        zip(
            prompts,
            cluster_fixture.reference_texts([{"prompt": p} for p in prompts], MIGRATE_TOKENS),
            strict=True,
        )
    )
    migrated = router_migrations(live)
    texts = streams_across(
        client,
        prompts,
        lambda: cluster_fixture.kvctl(live.redis_url, "role", changed, "prefill", "--migrate"),
        MIGRATE_TOKENS,
    )
    assert texts == want
    assert router_migrations(live) > migrated, "no stream was migrated off the changing node"
    assert nodes(live)[changed]["info"]["role"] == "prefill"
    assert live.metric(changed, "pdserve_node_role_changes_total", {"to_role": "prefill"}) == 1
    live.wait_clean()
