"""Decode graphs: bucket choice, static buffers and padding give the eager runner's logits and KV writes.

CPU tests run DecodeGraphs eagerly (capture=False) on a 2-layer SmolLM2-shaped model with the torch
reference ops: the same staging, padding and fixed max_seq_len a captured graph replays. GPU tests
(@pytest.mark.gpu) capture real graphs over the Triton kernels and check the memory comes back.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.cuda_graphs import DecodeGraphs, bucket_sizes, pick_bucket
from pdserve.shared.engine.model_runner import BatchItem, ModelRunner
from pdserve.tests.harness.graphs import (
    BLOCK,
    MAX_LEN,
    MAX_SEQS,
    NUM_BLOCKS,
    cpu_runner,
    on_gpu,
    on_gpu_frees_memory,
    replay_matches_eager,
    uncaptured,
)

__all__ = ["cpu_runner"]  # the fixture, from the harness


def eager_graphs(runner: ModelRunner) -> DecodeGraphs:
    return uncaptured(DecodeGraphs, runner, bucket_sizes(MAX_SEQS))


def decode_batch(rng: random.Random, n: int, vocab: int) -> list[BatchItem]:
    """n sequences at random context lengths over disjoint random blocks; each feeds its last token."""
    blocks = rng.sample(range(NUM_BLOCKS), n * (MAX_LEN // BLOCK))
    items = []
    for i in range(n):
        seq_len = rng.randint(1, MAX_LEN)
        own = blocks[i * (MAX_LEN // BLOCK) : i * (MAX_LEN // BLOCK) + -(-seq_len // BLOCK)]
        tokens = [rng.randrange(vocab) for _ in range(seq_len)]
        items.append(BatchItem(tokens, seq_len - 1, 1, own, sample=True))
    return items


def test_buckets() -> None:
    assert bucket_sizes(1) == (1,)
    assert bucket_sizes(64) == (1, 2, 4, 8, 16, 32, 64)
    assert bucket_sizes(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        bucket_sizes(0)
    with pytest.raises(ValueError, match="batch of 101 rows"):
        pick_bucket(bucket_sizes(100), 101)


@given(st.integers(1, 300), st.integers(1, 300))
def test_pick_bucket_is_smallest_fit(max_num_seqs: int, n: int) -> None:
    buckets = bucket_sizes(max_num_seqs)
    if n > max_num_seqs:
        with pytest.raises(ValueError):
            pick_bucket(buckets, n)
        return
    b = pick_bucket(buckets, n)
    assert b >= n and all(x < n for x in buckets if x < b)


@settings(max_examples=12, deadline=None)
@given(st.integers(1, MAX_SEQS), st.integers(0, 2**32))
def test_static_path_matches_eager_runner(cpu_runner: ModelRunner, n: int, seed: int) -> None:
    """Same logits and the same KV cache afterwards: padding rows write nothing, attend harmlessly."""
    rng = random.Random(seed)
    items = decode_batch(rng, n, cpu_runner.config.vocab_size)
    cpu_runner.kv_cache.normal_(generator=torch.Generator().manual_seed(seed))
    before = cpu_runner.kv_cache.clone()
    want = cpu_runner.execute(items)
    kv_eager = cpu_runner.kv_cache.clone()
    cpu_runner.kv_cache.copy_(before)
    graphs = eager_graphs(cpu_runner)
    with torch.inference_mode():
        got = graphs.run(
            [it.token_ids[it.start] for it in items],
            [it.block_ids for it in items],
            [it.start + 1 for it in items],
        )
    assert got.shape == want.shape == (n, cpu_runner.config.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # matmuls over a padded batch may round differently, so written slots match closely; every other
    # slot (padding rows write none) is untouched
    torch.testing.assert_close(cpu_runner.kv_cache, kv_eager, rtol=1e-5, atol=1e-5)
    written = _written_mask(cpu_runner, items)
    assert torch.equal(cpu_runner.kv_cache[:, :, ~written], before[:, :, ~written])


def _written_mask(runner: ModelRunner, items: list[BatchItem]) -> torch.Tensor:
    """[num_blocks, block_size] bool: the slot each item's new token goes to."""
    mask = torch.zeros(NUM_BLOCKS, BLOCK, dtype=torch.bool)
    for it in items:
        mask[it.block_ids[it.start // BLOCK], it.start % BLOCK] = True
    return mask


def test_runner_routes_decode_only_batches(cpu_runner: ModelRunner) -> None:
    """Decode-only batches without a hook go through the graphs (unsampled rows dropped); a batch with a
    prefill chunk, a layer hook, or a context past max_model_len runs eagerly with the same result."""
    rng = random.Random(7)
    items = decode_batch(rng, 5, cpu_runner.config.vocab_size)
    items[2] = dataclasses.replace(items[2], sample=False)
    want = cpu_runner.execute(items, layer_hook=lambda layer: None)  # a hook forces the eager path
    cpu_runner.graphs = graphs = eager_graphs(cpu_runner)
    calls: list[int] = []
    real_run = graphs.run

    def counting_run(*args: Any) -> torch.Tensor:
        calls.append(len(args[0]))
        return real_run(*args)

    graphs.run = counting_run  # type: ignore[method-assign,assignment]
    try:
        got = cpu_runner.execute(items)
        assert calls == [5] and got.shape[0] == 4
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        mixed = [*items[:2], BatchItem(items[3].token_ids, 0, 3, items[3].block_ids, sample=True)]
        cpu_runner.execute(mixed)
        too_long = BatchItem([0] * (MAX_LEN + 1), MAX_LEN, 1, list(range(MAX_LEN // BLOCK + 1)), True)
        assert not graphs.fits([too_long.start + 1])
        assert calls == [5]
    finally:
        cpu_runner.graphs = None
    graphs.close()
    graphs.close()
    with pytest.raises(RuntimeError, match="after close"):
        graphs.run([0], [[0]], [1])


def test_run_refuses_rows_without_blocks(cpu_runner: ModelRunner) -> None:
    graphs = eager_graphs(cpu_runner)
    with pytest.raises(AssertionError, match="cannot hold position 16"), torch.inference_mode():
        graphs.run([1], [[3]], [17])


@on_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_graphs_match_eager_and_free_memory(dtype: torch.dtype) -> None:
    def exercise(runner: ModelRunner) -> None:
        assert runner.graphs is not None and runner.graphs.pool_bytes > 0
        rng = random.Random(3)
        for n in (1, 3, MAX_SEQS):
            items = decode_batch(rng, n, runner.config.vocab_size)
            replay_matches_eager(
                runner, items, _written_mask(runner, items), 1e-4 if dtype == torch.float32 else 2e-2
            )

    dtype_name = str(dtype).removeprefix("torch.")
    cfg = EngineConfig(model="dummy:tiny", device="cuda", dtype=dtype_name, max_num_seqs=MAX_SEQS)
    on_gpu_frees_memory(cfg, dtype, exercise)


def test_rows_fed_from_the_previous_steps_tokens_match_host_tokens(cpu_runner: ModelRunner) -> None:
    """Async scheduling: an item with `prev_row` takes its input id from the previous step's token tensor
    (on the device) and gives the logits of the same item fed from the host, through the graphs (the
    static buffers' device-side fill) and eagerly (beside a prefill chunk)."""
    rng = random.Random(11)
    items = decode_batch(rng, 4, cpu_runner.config.vocab_size)
    want = cpu_runner.execute(items, layer_hook=lambda layer: None)
    prev = torch.tensor([7, items[1].token_ids[-1], 5, items[3].token_ids[-1]], dtype=torch.int64)
    fed = list(items)
    for i, row in ((1, 1), (3, 3)):
        it = items[i]
        fed[i] = dataclasses.replace(it, token_ids=it.token_ids[:-1], prev_row=row)
    cpu_runner.graphs = graphs = eager_graphs(cpu_runner)
    try:
        got = cpu_runner.execute(fed, prev_tokens=prev)
    finally:
        cpu_runner.graphs = None
        graphs.close()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    eager = cpu_runner.execute(fed, layer_hook=lambda layer: None, prev_tokens=prev)
    torch.testing.assert_close(eager, want, rtol=1e-5, atol=1e-5)
