"""The P/D KV path under the traffic an operator sends, through real processes and the official client:
a prefix P serves from its own cache but the chosen D lacks is sent (after `kvctl evict` on D, and with a
shared system prompt over two decode nodes); `max_tokens=1` completes on P/D and D keeps nothing; a decode
pool far smaller than the load queues transfers instead of refusing them. Each scenario compares with the
greedy text of `pdserve generate` and ends with clean audits on every node.

Before the fix (issue 17): the evicted-prefix requests got 500 ("... layer-blocks missing"), max_tokens=1
got 500 and left 5 blocks in use on D per request, and 15 of 32 requests under KV pressure failed with
"no free KV blocks".
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
from pdserve.tests.harness import cluster_fixture

pytestmark = pytest.mark.slow

MODEL = cluster_fixture.served_model_name()
SYSTEM = " ".join(
    f"Rule {i}: answer in one short sentence, name the topic, and never mention rule {i + 1}."
    for i in range(12)
)
DOCUMENT = " ".join(
    f"Section {i} of the lease says the rent rises by {i} percent in year {i}." for i in range(20)
)


def client(live: cluster_fixture.LiveCluster) -> openai.OpenAI:
    return live.openai(timeout=300)


HELD = [DOCUMENT + " Summary:", DOCUMENT + " The rent in year 3 rises by"]
CHATS = [
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {w}?"}]
    for w in ("rain", "a comet", "a harbour", "bread", "a violin", "granite")
]
ONE_TOKEN = DOCUMENT + " In one word, the lease is"
QUEUED = [f"Request {i}: list three facts about the number {i}, each in a short sentence." for i in range(32)]


@pytest.fixture(scope="module")
def book() -> dict[str, str]:
    """Every test's greedy references, from one offline run."""
    lines = [{"prompt": p, "max_tokens": 12} for p in HELD]
    lines += [{"messages": m, "max_tokens": 10} for m in CHATS]
    lines += [{"prompt": ONE_TOKEN, "max_tokens": 1}]
    lines += [{"prompt": p, "max_tokens": 16} for p in QUEUED]
    return cluster_fixture.reference_book(lines)


def greedy(book: dict[str, str], lines: list[dict[str, Any]]) -> list[str]:
    return [book[cluster_fixture.book_key(line)] for line in lines]


def served(c: openai.OpenAI, line: dict[str, Any]) -> str:
    """The cluster's greedy text for a book line: a chat when it has "messages", else a completion."""
    if "messages" in line:
        return c.chat.completions.create(model=MODEL, temperature=0, **line).choices[0].message.content or ""
    return c.completions.create(model=MODEL, temperature=0, **line).choices[0].text


@pytest.fixture(scope="module")
def live() -> Iterator[cluster_fixture.LiveCluster]:
    yield from cluster_fixture.live_cluster(prefill=1, decode=2)


def test_a_prefix_p_holds_and_d_lacks_is_sent(
    live: cluster_fixture.LiveCluster, book: dict[str, str]
) -> None:
    c = client(live)
    lines = [{"prompt": p, "max_tokens": 12} for p in HELD]
    want = greedy(book, lines)
    assert served(c, lines[0]) == want[0]
    for node in ("decode-0", "decode-1"):  # P keeps the prefix; neither D has it any more
        cluster_fixture.kvctl_main(live.redis_url, "evict", "--node", node, "--all")
    assert served(c, lines[0]) == want[0]
    assert served(c, lines[1]) == want[1]  # the same prefix plus a new suffix
    live.wait_clean()


def test_a_shared_system_prompt_over_two_decode_nodes(
    live: cluster_fixture.LiveCluster, book: dict[str, str]
) -> None:
    c = client(live)
    lines = [{"messages": m, "max_tokens": 10} for m in CHATS]
    want = greedy(book, lines)
    with ThreadPoolExecutor(max_workers=4) as pool:
        got = list(pool.map(lambda line: served(c, line), lines * 2))
    assert got == want * 2
    live.wait_clean()


def test_max_tokens_1_completes_and_d_keeps_nothing(
    live: cluster_fixture.LiveCluster, book: dict[str, str]
) -> None:
    c = client(live)
    prompt = ONE_TOKEN
    (want,) = greedy(book, [{"prompt": prompt, "max_tokens": 1}])
    for _ in range(3):
        reply = c.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
        assert reply.choices[0].text == want and reply.choices[0].finish_reason == "length"
        assert reply.usage is not None and reply.usage.completion_tokens == 1
    stream = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say yes."}],
        max_tokens=1,
        temperature=0,
        stream=True,
    )
    reasons = [ch.choices[0].finish_reason for ch in stream if ch.choices]
    assert reasons[-1] == "length"
    live.wait_clean()


def test_a_full_decode_pool_queues_transfers_instead_of_refusing_them(book: dict[str, str]) -> None:
    # D's pool holds 12 blocks of 16 tokens; each request needs 3 (a ~20-token prompt + 16 tokens), and D
    # keeps a free block per live request, so at most 3 run at once against 32 in flight: over 8x.
    cfg = cluster_fixture.up_config(
        prefill=1, decode=1, role_node_args=(("decode", ("--num-kv-blocks", "12")),)
    )
    with cluster_fixture.LiveCluster.start(cfg) as live:
        lines = [{"prompt": p, "max_tokens": 16} for p in QUEUED]
        want = greedy(book, lines)
        c = client(live)
        with ThreadPoolExecutor(max_workers=32) as pool:
            got = list(pool.map(lambda line: served(c, line), lines))
        assert got == want
        live.wait_clean()
