"""The CPU prefill attention (kernels/reference.py): exact against a plain fp64 softmax, and computed by
torch's fused CPU flash kernel, never by its math fallback.

The math fallback materializes every head's [Lq, Lk] score matrix and runs it through bmm, softmax and a
fully-masked-row fix-up: quadratic memory traffic that made a 1,650-token prefill twice as slow as Hugging
Face's forward (issue 31). Which kernel ran is read from the profiler's operator names, not from a clock.
Sequences with a cached prefix (a chunk that starts past position 0) are covered beside fresh prompts.
"""

from __future__ import annotations

import pytest
import torch
from pdserve.kernels.ops import AttentionMetadata, RopeTables
from pdserve.kernels.reference import ReferenceOps
from torch.profiler import ProfilerActivity, profile

BLOCK = 16
HQ, HKV, D = 9, 3, 64  # SmolLM2-135M's heads
MATH = "aten::_scaled_dot_product_attention_math"
FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"


def _batch(
    spans: list[tuple[int, int]], seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """spans: (cached prefix, new tokens) per sequence -> q [T, HQ, D], kv_layer, metadata; the cache holds
    random K/V in shuffled blocks (attention reads whatever the cache holds)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(p + n) // BLOCK) for p, n in spans]
    order = torch.randperm(sum(need) + 3, generator=gen).tolist()
    tables, at = [], 0
    for n_blocks in need:
        tables.append(order[at : at + n_blocks])
        at += n_blocks
    width = max(need)
    kv_layer = torch.randn(2, sum(need) + 3, BLOCK, HKV, D, generator=gen)
    n_tokens = sum(n for _, n in spans)
    q = torch.randn(n_tokens, HQ, D, generator=gen)
    starts = [0]
    for _, n in spans:
        starts.append(starts[-1] + n)
    rope = RopeTables.from_inv_freq(torch.ones(D // 2), 8, torch.device("cpu"))
    meta = AttentionMetadata(
        positions=torch.cat([torch.arange(p, p + n) for p, n in spans]),
        slot_mapping=torch.full((n_tokens,), -1, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([p + n for p, n in spans], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(n for _, n in spans),
        max_seq_len=max(p + n for p, n in spans),
        rope=rope,
    )
    return q, kv_layer, meta


def _naive(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """fp64 softmax(q k^T) v per sequence and head, causal at each query's position."""
    out = torch.empty(q.shape, dtype=torch.float64)
    starts = meta.query_start_loc.tolist()
    for s, seq_len in enumerate(meta.seq_lens.tolist()):
        q0, q1 = starts[s], starts[s + 1]
        blocks = meta.block_tables[s, : -(-seq_len // BLOCK)].long()
        k = kv_layer[0, blocks].flatten(0, 1)[:seq_len].double()  # [Lk, HKV, D]
        v = kv_layer[1, blocks].flatten(0, 1)[:seq_len].double()
        k, v = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)  # [Lk, HQ, D]
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].double(), k) * scale  # [HQ, Lq, Lk]
        q_pos = torch.arange(seq_len - (q1 - q0), seq_len)
        scores.masked_fill_(torch.arange(seq_len)[None, :] > q_pos[:, None], float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


SPANS = [
    [(0, 300)],  # a fresh prompt
    [(160, 140)],  # a chunk after a cached prefix of whole blocks
    [(37, 200)],  # after a prefix that ends mid-block
    [(0, 1), (0, 70), (64, 33), (290, 1), (5, 250)],  # a varlen batch, one-token items among them
]


@pytest.mark.parametrize("spans", SPANS)
def test_prefill_attention_matches_fp64_softmax(spans: list[tuple[int, int]]) -> None:
    q, kv_layer, meta = _batch(spans)
    got = ReferenceOps().prefill_attention(q, kv_layer, meta, scale=D**-0.5)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got.double(), _naive(q, kv_layer, meta, D**-0.5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spans", SPANS[:3])
def test_prefill_attention_runs_the_fused_cpu_kernel(spans: list[tuple[int, int]]) -> None:
    torch.set_num_threads(1)
    q, kv_layer, meta = _batch(spans)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        ReferenceOps().prefill_attention(q, kv_layer, meta, scale=D**-0.5)
    names = {event.key for event in prof.key_averages()}
    assert MATH not in names, sorted(n for n in names if "attention" in n)
    assert FLASH in names, sorted(n for n in names if "attention" in n)


def test_cpu_rope_is_hugging_faces_and_hands_attention_contiguous_heads() -> None:
    # The flash kernel reads q as [Hq, T, D]; q rotated in place in qkv reached it with each token's heads
    # interleaved, and the rotation built five temporaries and a concatenation (issue 31). The rotation
    # now writes each half once into a head-major buffer, with HF's fp32 roundings: equal bit for bit.
    gen = torch.Generator().manual_seed(4)
    n_tokens = 40
    qkv = torch.randn(n_tokens, (HQ + 2 * HKV) * D, generator=gen)
    kv_layer = torch.zeros(2, 4, BLOCK, HKV, D)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    meta = AttentionMetadata(
        positions=torch.arange(7, 7 + n_tokens),
        slot_mapping=torch.arange(n_tokens),
        query_start_loc=torch.tensor([0, n_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([n_tokens], dtype=torch.int32),
        block_tables=torch.arange(4, dtype=torch.int32)[None],
        max_query_len=n_tokens,
        max_seq_len=n_tokens,
        rope=RopeTables.from_inv_freq(inv_freq, 64, torch.device("cpu")),
    )
    q = ReferenceOps().rope_write_kv(qkv.clone(), kv_layer, meta, HQ)
    c = torch.cat([meta.rope.cos[meta.positions]] * 2, -1)[:, None]  # [T, 1, D]
    s = torch.cat([meta.rope.sin[meta.positions]] * 2, -1)[:, None]
    qk = qkv[:, : (HQ + HKV) * D].view(n_tokens, HQ + HKV, D)
    want = qk * c + torch.cat((-qk[..., D // 2 :], qk[..., : D // 2]), -1) * s  # HF's apply_rotary_pos_emb
    assert torch.equal(q, want[:, :HQ])
    assert torch.equal(kv_layer[0].flatten(0, 1)[:n_tokens], want[:, HQ:])
    assert q.transpose(0, 1).is_contiguous(), q.stride()
