"""Prefill graphs: one sequence's short step (new tokens over a cached context) replayed from static
buffers gives the eager runner's logits and KV writes, and the runner routes exactly those steps to it.

CPU tests run PrefillGraphs eagerly (capture=False) on a 2-layer SmolLM2-shaped model with the torch
reference ops: the same staging, padding rows and fixed max_seq_len a captured graph replays. The GPU test
(@pytest.mark.gpu) captures real graphs over the Triton kernels and checks the memory comes back.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.cuda_graphs import prefill_buckets
from pdserve.shared.engine.model_runner import BatchItem, ModelRunner
from pdserve.shared.engine.prefill_graphs import PrefillGraphs
from pdserve.tests.harness.graphs import (
    BLOCK,
    MAX_LEN,
    NUM_BLOCKS,
    cpu_runner,
    on_gpu,
    on_gpu_frees_memory,
    replay_matches_eager,
    uncaptured,
)

__all__ = ["cpu_runner"]  # the fixture, from the harness (shared with the decode graphs' tests)


def eager_graphs(runner: ModelRunner, max_num_batched_tokens: int = 2048) -> PrefillGraphs:
    return uncaptured(PrefillGraphs, runner, prefill_buckets(max_num_batched_tokens))


def prefill_item(rng: random.Random, context: int, new: int, vocab: int, sample: bool = True) -> BatchItem:
    """`new` tokens over `context` cached ones, on random distinct blocks."""
    blocks = rng.sample(range(NUM_BLOCKS), -(-(context + new) // BLOCK))
    tokens = [rng.randrange(vocab) for _ in range(context + new)]
    return BatchItem(tokens, context, new, blocks, sample)


def _written(item: BatchItem) -> torch.Tensor:
    """[num_blocks, block_size] bool: the slots the item's new tokens go to."""
    mask = torch.zeros(NUM_BLOCKS, BLOCK, dtype=torch.bool)
    for p in range(item.start, item.start + item.num_tokens):
        mask[item.block_ids[p // BLOCK], p % BLOCK] = True
    return mask


@settings(max_examples=12, deadline=None)
@given(st.integers(0, MAX_LEN - 1), st.integers(1, 64), st.integers(0, 2**32))
def test_static_path_matches_eager_runner(cpu_runner: ModelRunner, context: int, new: int, seed: int) -> None:
    """Same logits and KV: padding rows write nothing, and a bucket larger than the step changes nothing."""
    new = min(new, MAX_LEN - context)
    rng = random.Random(seed)
    item = prefill_item(rng, context, new, cpu_runner.config.vocab_size)
    cpu_runner.kv_cache.normal_(generator=torch.Generator().manual_seed(seed))
    before = cpu_runner.kv_cache.clone()
    want = cpu_runner.execute([item])
    kv_eager = cpu_runner.kv_cache.clone()
    cpu_runner.kv_cache.copy_(before)
    with torch.inference_mode():
        got = eager_graphs(cpu_runner).run(item.token_ids, item.start, item.num_tokens, item.block_ids)
    assert got.shape == want.shape == (1, cpu_runner.config.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cpu_runner.kv_cache, kv_eager, rtol=1e-5, atol=1e-5)
    written = _written(item)
    assert torch.equal(cpu_runner.kv_cache[:, :, ~written], before[:, :, ~written])


def test_runner_routes_short_single_sequence_prefills(cpu_runner: ModelRunner) -> None:
    """One sequence's short step replays (a layer hook then runs for every layer, in order, after it; an
    unsampled chunk gives no logits); a batch of two, a token from the previous step, or a context past
    max_model_len runs eagerly."""
    rng = random.Random(5)
    vocab = cpu_runner.config.vocab_size
    item = prefill_item(rng, 40, 20, vocab)
    want = cpu_runner.execute([item])
    cpu_runner.prefill_graphs = graphs = eager_graphs(cpu_runner)
    calls: list[int] = []
    real_run = graphs.run

    def counting_run(*args: Any) -> torch.Tensor:
        calls.append(args[2])
        return real_run(*args)

    graphs.run = counting_run  # type: ignore[method-assign,assignment]
    hooked: list[int] = []
    try:
        got = cpu_runner.execute([item], layer_hook=hooked.append)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert calls == [20] and hooked == list(range(cpu_runner.config.num_layers))
        unsampled = BatchItem(item.token_ids, 0, 16, item.block_ids, sample=False)
        assert cpu_runner.execute([unsampled]).shape == (0, vocab)
        assert calls == [20, 16]
        cpu_runner.execute([item, prefill_item(rng, 3, 5, vocab)])
        prev = torch.tensor([7])
        cpu_runner.execute(
            [BatchItem(item.token_ids, 40, 1, item.block_ids, True, prev_row=0)], prev_tokens=prev
        )
        assert not graphs.fits(8, MAX_LEN + 1) and not graphs.fits(513, 520)
        assert calls == [20, 16]
    finally:
        cpu_runner.prefill_graphs = None
    graphs.close()
    graphs.close()
    with pytest.raises(RuntimeError, match="after close"):
        graphs.run([0], 0, 1, [0])


def test_no_bucket_under_a_small_token_budget(cpu_runner: ModelRunner) -> None:
    graphs = eager_graphs(cpu_runner, max_num_batched_tokens=15)
    assert graphs.buckets == () and not graphs.fits(1, 1)


@on_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_prefill_graphs_match_eager_and_free_memory(dtype: torch.dtype) -> None:
    def exercise(runner: ModelRunner) -> None:
        assert runner.prefill_graphs is not None and runner.prefill_graphs.buckets == (16, 64, 256, 512)
        rng = random.Random(3)
        for context, new in ((0, 1), (0, 16), (37, 5), (90, 38), (100, 28)):
            item = prefill_item(rng, context, new, runner.config.vocab_size)
            replay_matches_eager(runner, [item], _written(item), 1e-4 if dtype == torch.float32 else 2e-2)

    cfg = EngineConfig(model="dummy:tiny", device="cuda", dtype=str(dtype).removeprefix("torch."))
    on_gpu_frees_memory(cfg, dtype, exercise)
