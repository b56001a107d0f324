"""The host-memory KV tier on the CPU build (a second, slower pool), on the real SmolLM2 GGUF: a prefix the
device pool evicted comes back from the host tier on the next hit (restored blocks counted, prompt tokens
served as cached instead of computed) and the tokens equal those of an engine that recomputed it; the pool
ends clean in both tiers' bookkeeping. The same with an FP8 cache, whose bytes the tier moves as they are.
"""

from __future__ import annotations

import pytest
from pdserve.shared.cli.offline import generate
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import LLMEngine
from pdserve.shared.engine.model_runner import kv_bytes_per_block
from pdserve.shared.engine.sampling_params import SamplingParams
from pdserve.shared.model.loader import LoadedModel
from pdserve.shared.types import RequestId

pytestmark = pytest.mark.slow
BLOCK = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def _prompt(loaded: LoadedModel, topic: str, n: int) -> list[int]:
    text = " ".join(f"{topic} fact {i}: the value of item {i} is {i * 11 % 97}." for i in range(n))
    return loaded.tokenizer.encode(text)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_an_evicted_prefix_comes_back_from_the_host_tier(loaded: LoadedModel, kv_cache_dtype: str) -> None:
    prefix, filler = _prompt(loaded, "Harbour", 24), _prompt(loaded, "Orchard", 30)
    question = loaded.tokenizer.encode(" Which item is worth the most?")
    # exactly the filler's blocks: running it evicts every block the prefix left cached
    num_blocks = -(-(len(filler) + GREEDY.max_tokens) // BLOCK)
    cfg = EngineConfig(
        model=loaded.source, block_size=BLOCK, num_kv_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype
    )
    per_block = kv_bytes_per_block(loaded, cfg)
    tiered = LLMEngine(cfg.__class__(**{**cfg.__dict__, "host_kv_cache_bytes": 64 * per_block}), loaded)
    recompute = LLMEngine(cfg, loaded)
    assert tiered.host_blocks == 64 and tiered.tier is not None

    want = [generate(recompute, [(p, GREEDY)])[0].token_ids for p in (prefix, filler, prefix + question)]
    for p in (prefix, filler):
        generate(tiered, [(p, GREEDY)])
    audit = tiered.audit()
    assert audit.host >= len(prefix) // BLOCK, f"the prefix went to the host tier: {audit}"
    assert not tiered.cached_prefix_blocks(
        tiered.prompt_hashes(tiered.new_request(RequestId("x"), prefix, GREEDY))
    )
    computed = tiered.scheduler.stats.computed_prompt_tokens
    got = generate(tiered, [(prefix + question, GREEDY)])[0]
    assert got.token_ids == want[2]
    restored = tiered.tier.restored
    assert restored >= len(prefix) // BLOCK - 1, f"{restored} blocks came back"
    assert (
        tiered.scheduler.stats.computed_prompt_tokens - computed
        <= len(prefix + question) - (len(prefix) // BLOCK - 1) * BLOCK
    )
    audit = tiered.audit()
    assert (audit.in_use, audit.reserved) == (0, 0) and audit.free + audit.cached == num_blocks
