"""The chaos suite's 1,000 concurrent streams (issues 19 and 20), lean enough for CI: a 1 P + 1 D cluster of
real processes whose router admits 16 requests per node and queues 100 more, and 1,000 streamed completions
(4 greedy tokens each, 16 distinct prompts) sent at once from one asyncio client.

Asserts: every request either completes with the greedy text of `pdserve generate` or is refused with
429/503 and Retry-After before anything streams (an OpenAI-style error body); none fails after streaming
began; none hangs (every request has a client-side limit); the router stays healthy; afterwards both nodes
hold no block and no request, and `kvctl diff` finds the index in agreement with both nodes. The full-size
run (2 P + 2 D, 16 tokens, the router's and nodes' CPU time) is benchmarks/streams.py.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx2
import pytest
from pdserve.tests.harness import cluster_fixture
from pdserve.tests.harness.chaos_faults import SMALL_KV

pytestmark = pytest.mark.slow

MODEL = cluster_fixture.served_model_name()
STREAMS = 1000
MAX_TOKENS = 4
LIMIT_S = 240.0
PROMPTS = [f"Stream test {i}: the best thing about mornings is" for i in range(16)]


async def _one(client: httpx2.AsyncClient, base: str, prompt: str) -> tuple[str, str]:
    """('ok', text) | ('refused', why) before any byte streamed | ('failed', why) | ('hung', '')."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    try:
        async with asyncio.timeout(LIMIT_S):
            async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raw = await r.aread()
                    error = json.loads(raw)["error"]
                    if r.status_code in (429, 503) and r.headers.get("retry-after") and error.get("code"):
                        return "refused", f"{r.status_code} {error['code']}"
                    return "failed", f"HTTP {r.status_code}: {raw[:200]!r}"
                text, done = "", False
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            return "failed", f"after streaming: {chunk['error']}"
                        text += chunk["choices"][0]["text"]
                return ("ok", text) if done else ("failed", "stream ended without [DONE]")
    except TimeoutError:
        return "hung", ""
    except httpx2.HTTPError as exc:
        return "failed", f"{type(exc).__name__}: {exc}"


async def _burst(base: str) -> list[tuple[str, str]]:
    limits = httpx2.Limits(max_connections=STREAMS + 8, max_keepalive_connections=STREAMS + 8)
    timeout = httpx2.Timeout(LIMIT_S, connect=60.0)
    async with httpx2.AsyncClient(timeout=timeout, limits=limits) as client:
        return list(
            await asyncio.gather(*(_one(client, base, PROMPTS[i % len(PROMPTS)]) for i in range(STREAMS)))
        )


def test_a_thousand_concurrent_streams_complete_or_are_refused_before_streaming() -> None:
    router = ("--max-requests-per-node", "16", "--max-queued-requests", "100")
    with cluster_fixture.LiveCluster.start(
        cluster_fixture.up_config(prefill=1, decode=1, extra_node_args=SMALL_KV, router_args=router)
    ) as live:
        texts = cluster_fixture.reference_texts([{"prompt": p} for p in PROMPTS], MAX_TOKENS)
        want = dict(zip(PROMPTS, texts, strict=True))

        t0 = time.monotonic()
        got = asyncio.run(_burst(live.base))
        wall = time.monotonic() - t0
        kinds = {k: sum(1 for o, _ in got if o == k) for k in ("ok", "refused", "failed", "hung")}
        reasons = sorted({why for o, why in got if o == "refused"})
        print(f"\n{STREAMS} streams in {wall:.1f} s: {kinds}, refusals {reasons}")
        bad = [(i, o, why) for i, (o, why) in enumerate(got) if o in ("failed", "hung")]
        assert not bad, f"{len(bad)} requests failed or hung, e.g. {bad[:5]}"
        wrong = [
            (i, text)
            for i, (o, text) in enumerate(got)
            if o == "ok" and text != want[PROMPTS[i % len(PROMPTS)]]
        ]
        assert not wrong, f"{len(wrong)} completions differ from the reference, e.g. {wrong[:3]}"
        assert kinds["ok"] >= 116, kinds  # at least what fits at once: 16 per node in flight + 100 queued
        assert httpx2.get(f"{live.base}/health", timeout=30).status_code == 200

        live.wait_clean(timeout_s=60)
        rows = cluster_fixture.kvctl_main(live.redis_url, "diff", "--timeout", "60")["nodes"]
        for name in live.nodes:
            row = rows.get(name)
            assert row is not None and "error" not in row and row["extra"] == row["missing"] == 0, rows
