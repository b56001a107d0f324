"""A drain that moves a decode node's running requests WITH their KV (issue 39), through real processes
(redis-server, 1 P, 2 D, the router) on SmolLM2: four long greedy streams through the official openai
client, two or more of them on the decode node drained mid-stream with `kvctl drain D --migrate`. The node
ends those requests with a migration signal, the router continues each on the other pair, and the
continuation's KV (prompt + tokens already generated) is fetched from the draining node instead of being
prefilled: every stream ends with its greedy reference text and no error chunk, the router counts the
continuations' prompt tokens as fetched (at most the last partial block or two computed), P's fetch counter
shows the blocks that came, and the drained node leaves the index only once they were pulled, its pool clean.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import openai
import pytest
from pdserve.kvctl.commands import tokenize
from pdserve.node.drain_migrate import RequestMover
from pdserve.node.node_metrics import NodeMetrics
from pdserve.shared.engine.async_engine import AsyncEngine
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import LLMEngine
from pdserve.shared.engine.sampling_params import SamplingParams
from pdserve.shared.model.loader import LoadedModel
from pdserve.shared.node.node_protocol import StepOutput
from pdserve.shared.types import NodeId, RequestId
from pdserve.tests.harness import cluster_fixture
from pdserve.tests.harness.chaos_faults import SMALL_KV
from pdserve.tests.harness.chaos_load import metric_of

pytestmark = pytest.mark.slow

MODEL = cluster_fixture.served_model_name()
PROMPTS = [
    f"Write a long, detailed story about {w}, with many characters, places and events. Once upon a time,"
    for w in ("a lighthouse keeper", "a river town", "a clockmaker", "a mountain pass")
]
MAX_TOKENS = 160
BS = 16
DECODE = ("decode-0", "decode-1")


@dataclass
class Stream:
    prompt: str
    chunks: int = 0
    text: str = ""
    finish_reason: str | None = None
    usage: tuple[int, int] | None = None
    """(prompt_tokens, completion_tokens) of the stream's usage chunk."""
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def run(self, client: openai.OpenAI) -> None:
        try:
            stream = client.completions.create(
                model=MODEL, prompt=self.prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )  # fmt: skip
            for chunk in stream:
                if chunk.usage is not None:
                    self.usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                self.text += choice.text
                self.chunks += 1
                if choice.finish_reason is not None:
                    self.finish_reason = choice.finish_reason
        except openai.OpenAIError as exc:
            self.error = repr(exc)
        finally:
            self.done.set()


@pytest.fixture(scope="module")
def live() -> Iterator[cluster_fixture.LiveCluster]:
    yield from cluster_fixture.live_cluster(prefill=1, decode=2, extra_node_args=SMALL_KV)


def wait_for(what: str, check: object, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"waited {timeout_s:.0f}s for {what}"
        time.sleep(0.05)


def in_flight(live: cluster_fixture.LiveCluster, node: str) -> float:
    return metric_of(live.base, "pdserve_router_node_requests_in_flight", {"node_id": node})


def test_drain_migrate_moves_running_streams_with_their_kv(live: cluster_fixture.LiveCluster) -> None:
    reference = cluster_fixture.reference_texts([{"prompt": p} for p in PROMPTS], MAX_TOKENS, "--ignore-eos")
    want = dict(zip(PROMPTS, reference, strict=True))
    streams = [Stream(p) for p in PROMPTS]
    fetched_before = live.metric("prefill-0", "pdserve_node_fetched_blocks_total")
    with openai.OpenAI(base_url=f"{live.base}/v1", api_key="unused", max_retries=0, timeout=600) as client:
        threads = [threading.Thread(target=s.run, args=(client,), daemon=True) for s in streams]
        for t in threads:
            t.start()
        wait_for("4 streams in flight", lambda: sum(in_flight(live, d) for d in DECODE) >= 4)
        drained = max(DECODE, key=lambda d: in_flight(live, d))
        assert in_flight(live, drained) >= 2, "no decode node carries two streams"
        # the drain must find every stream decoding, several blocks past its prompt
        wait_for("every stream to pass 3 blocks", lambda: all(s.chunks >= 3 * BS for s in streams))
        assert not any(s.done.is_set() for s in streams), "a stream ended before the drain"
        reply = cluster_fixture.kvctl_main(live.redis_url, "drain", drained, "--migrate")
        for t in threads:
            t.join(timeout=600)
    migrated = reply["node_reply"]["migrated"]
    assert migrated >= 2, reply
    failed = [(s.prompt, s.error) for s in streams if s.error is not None]
    assert not failed, f"streams failed although they could move: {failed}"
    assert all(s.finish_reason == "length" for s in streams), [s.finish_reason for s in streams]
    wrong = [(s.prompt, s.text) for s in streams if s.text != want[s.prompt]]
    assert not wrong, f"another text than the greedy reference: {wrong[:1]}"
    prompt_tokens = {len(tokenize(cluster_fixture.model_path(), p, None)) for p in PROMPTS}
    usage = {s.usage for s in streams}  # the original request's, migrated or not
    assert usage == {(n, MAX_TOKENS) for n in prompt_tokens}, usage

    by_drain = metric_of(live.base, "pdserve_router_migrations_total", {"cause": "drain"})
    assert by_drain == migrated, f"the router continued {by_drain} of the {migrated} migrated requests"
    tokens = "pdserve_router_migration_prompt_tokens_total"
    fetched = metric_of(live.base, tokens, {"cause": "drain", "source": "fetched"})
    computed = metric_of(live.base, tokens, {"cause": "drain", "source": "computed"})
    assert fetched >= migrated * 3 * BS, f"only {fetched:.0f} continuation prompt tokens were fetched"
    assert computed <= migrated * 2 * BS, f"{computed:.0f} continuation prompt tokens were prefilled again"
    pulled = live.metric("prefill-0", "pdserve_node_fetched_blocks_total") - fetched_before
    assert pulled * BS >= fetched, f"P fetched {pulled:.0f} blocks for {fetched:.0f} fetched tokens"
    assert live.metric(drained, "pdserve_node_drain_migrations_total") == migrated

    def gone() -> bool:
        return drained not in {
            n["info"]["node_id"] for n in cluster_fixture.kvctl_main(live.redis_url, "nodes")["nodes"]
        }

    wait_for(f"{drained} to leave the index", gone, timeout_s=60)
    assert "released after its pull" in live.log(drained), live.log(drained)[-2000:]
    audits = live.wait_clean()  # the drained node's process still answers: its pool is back to clean
    assert audits[drained]["in_use"] == 0 and audits[drained]["reserved"] == 0, audits
    print(f"\n{migrated} streams moved off {drained} with their KV: {fetched:.0f} continuation prompt "
          f"tokens fetched ({pulled:.0f} blocks on prefill-0), {computed:.0f} computed; all 4 texts equal "
          "the greedy reference")  # fmt: skip


async def _move_one(loaded: LoadedModel, pulled: bool) -> None:
    """One request decoding on a real engine is moved: its last output carries the migration signal, its
    committed blocks (prompt and generated) stay pinned until pulled (or the window ends), then the pool
    is clean."""
    engine = LLMEngine(EngineConfig(model=loaded.source, block_size=BS, num_kv_blocks=64), loaded)
    aengine = AsyncEngine(engine)
    aengine.start()
    try:
        metrics = NodeMetrics("decode", devices=engine.devices)

        async def published() -> None:
            return None

        mover = RequestMover(NodeId("d0"), aengine, metrics, published, 30.0 if pulled else 0.0)
        prompt = loaded.tokenizer.encode(PROMPTS[0])
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        req = engine.new_request(RequestId("r"), prompt, params, None)
        outs: list[StepOutput] = []

        async def consume() -> None:
            async for out in aengine.generate(req):
                outs.append(out)

        task = asyncio.create_task(consume())
        while sum(len(o.token_ids) for o in outs) < 2 * BS:
            await asyncio.sleep(0.01)
        assert await mover.migrate_running() == 1
        await task
        assert outs[-1].finish_reason == "abort" and outs[-1].migrate, outs[-1]
        generated = sum(len(o.token_ids) for o in outs)
        audit = await aengine.call(engine.audit)
        assert mover.pinned() == 1 and audit.in_use >= (len(prompt) + generated - 1) // BS - 1, audit
        if pulled:
            await mover.pulled(req.block_hashes[:2])  # an export of the chain's first blocks: the same chain
        else:
            await mover.expire_due()  # nobody pulled within the window
        audit = await aengine.call(engine.audit)
        assert mover.pinned() == 0 and (audit.in_use, audit.reserved) == (0, 0), audit
        outcome = "pulled" if pulled else "expired"
        assert (
            metrics.registry.get_sample_value(
                "pdserve_node_drain_migration_pulls_total", {"outcome": outcome}
            )
            == 1.0
        )
        assert metrics.registry.get_sample_value("pdserve_node_drain_migrations_total") == 1.0
    finally:
        await aengine.stop()


@pytest.mark.parametrize("pulled", [True, False], ids=["pulled", "expired"])
def test_a_moved_requests_pin_ends_when_pulled_or_when_its_window_ends(
    loaded: LoadedModel, pulled: bool
) -> None:
    asyncio.run(_move_one(loaded, pulled))
