"""Triton kernels against the torch reference, on CPU tensors under the Triton interpreter.

tests/harness/triton_interpreter.py switches the interpreter on (and says why it must be on before a
kernel is decorated). Unused cache blocks and block-table padding hold large values, so a kernel that reads
outside a sequence's context produces a visibly wrong result.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
from pdserve.kernels.ops import AttentionMetadata, RopeTables
from pdserve.kernels.reference import ReferenceOps, write_kv
from pdserve.kernels.triton_attention import (
    _decode_split_kernel,
    choose_num_splits,
    choose_one_launch,
    choose_prefill_splits,
    decode_tickets,
    decode_tile,
    paged_decode_attention,
    paged_prefill_attention,
)
from pdserve.kernels.triton_ops import TritonOps
from pdserve.shared.model.model import rope_inv_freq
from pdserve.tests.harness import triton_interpreter  # noqa: F401  (the interpreter, or a skip on CUDA)
from triton.runtime.interpreter import InterpretedFunction

pytestmark = pytest.mark.extras  # needs triton, the [gpu] extra: `make test-extras`


REF = ReferenceOps()
TRI = TritonOps()
POISON = 50.0
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def test_kernels_run_under_the_interpreter() -> None:
    hint = "triton was imported before this module: run it in a pytest process of its own"
    assert isinstance(_decode_split_kernel, InterpretedFunction), hint
    assert isinstance(triton.language.standard.cdiv, InterpretedFunction), hint


def _batch(
    specs: list[tuple[int, int]],
    n_kv: int,
    group: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    kv_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """specs: (cached prefix length, new query tokens) per sequence. Returns q [T, Hq, D], a cache whose
    context slots hold random K/V (written with the reference) and the metadata, tables shuffled. The
    cache is in `kv_dtype` (default: q's dtype)."""
    gen = torch.Generator().manual_seed(seed)
    lens = [ctx + new for ctx, new in specs]
    n_per_seq = [-(-n // block_size) for n in lens]
    n_blocks = sum(n_per_seq) + 3
    kv = torch.full((2, n_blocks, block_size, n_kv, head_dim), POISON, dtype=kv_dtype or dtype)
    perm = torch.randperm(n_blocks - 1, generator=gen).tolist()
    width = max(n_per_seq) + 1
    tables = torch.full((len(specs), width), n_blocks - 1, dtype=torch.int32)  # padding: a poison block
    slots = []
    for s, (n, nb) in enumerate(zip(lens, n_per_seq, strict=True)):
        ids = [perm.pop() for _ in range(nb)]
        tables[s, :nb] = torch.tensor(ids, dtype=torch.int32)
        slots += [ids[i // block_size] * block_size + i % block_size for i in range(n)]
    key = torch.randn(len(slots), n_kv, head_dim, generator=gen)
    value = torch.randn(len(slots), n_kv, head_dim, generator=gen)
    write_kv(key, value, kv, torch.tensor(slots, dtype=torch.int64))
    starts = [0]
    for _, new in specs:
        starts.append(starts[-1] + new)
    q = torch.randn(starts[-1], n_kv * group, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata(
        positions=torch.cat([torch.arange(ctx, ctx + new) for ctx, new in specs]),
        slot_mapping=torch.empty(0, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(new for _, new in specs),
        max_seq_len=max(lens),
        rope=RopeTables.from_inv_freq(rope_inv_freq(head_dim, 10000.0, None), max(lens), torch.device("cpu")),
    )
    return q, kv, meta


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    tol = TOL[want.dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_gather_scatter_round_trip_matches_reference() -> None:
    gen = torch.Generator().manual_seed(2)
    kv = torch.randn(2, 10, 16, 3, 64, generator=gen)
    ids = torch.tensor([7, 2, 9, 0], dtype=torch.int64)
    out_tri = torch.empty(2, 4, 16, 3, 64)
    out_ref = torch.empty_like(out_tri)
    TRI.gather_blocks(kv, ids, out_tri)
    REF.gather_blocks(kv, ids, out_ref)
    assert torch.equal(out_tri, out_ref)
    dst_tri, dst_ref = torch.zeros_like(kv), torch.zeros_like(kv)
    src = torch.randn(2, 4, 16, 3, 64, generator=gen)
    TRI.scatter_blocks(src, dst_tri, ids)
    REF.scatter_blocks(src, dst_ref, ids)
    assert torch.equal(dst_tri, dst_ref)
    TRI.scatter_blocks(out_tri, dst_tri, ids)
    assert torch.equal(dst_tri[:, ids], kv[:, ids])


GQA_SHAPES = [(1, 64, 2), (3, 64, 1), (4, 128, 2), (8, 128, 1)]  # (group, head_dim, kv heads)


@pytest.mark.parametrize(("group", "head_dim", "n_kv"), GQA_SHAPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference(group: int, head_dim: int, n_kv: int, num_splits: int) -> None:
    # 1 token, one short of / exactly at / one past a block boundary, and a long one over many tiles.
    q, kv, meta = _batch([(0, 1), (14, 1), (15, 1), (16, 1), (150, 1)], n_kv, group, head_dim, seed=group)
    want = REF.decode_attention(q, kv, meta, scale=head_dim**-0.5)
    got = paged_decode_attention(
        q, kv, meta.block_tables, meta.seq_lens, head_dim**-0.5, num_splits, block_n=32
    )
    _close(got, want)


def test_decode_through_ops_with_empty_splits() -> None:
    # 700 tokens gives 3 splits under the interpreter's SM count; the 1-token sequence leaves two empty.
    q, kv, meta = _batch([(699, 1), (0, 1), (40, 1)], 1, 8, 64, seed=5)
    assert choose_num_splits(meta.num_seqs, 1, meta.max_seq_len, 4) == 3
    _close(TRI.decode_attention(q, kv, meta, scale=0.125), REF.decode_attention(q, kv, meta, scale=0.125))


def test_splits_past_one_reduction_chunk() -> None:
    # 40 splits: the reduction weighs them in three chunks of 16 with a running max; the short sequences
    # leave every chunk after the first empty (lse -inf), the 1,300-token one fills them all.
    q, kv, meta = _batch([(1299, 1), (0, 1), (30, 1)], 1, 2, 32, seed=6)
    got = paged_decode_attention(q, kv, meta.block_tables, meta.seq_lens, 0.2, 40, block_n=32)
    _close(got, REF.decode_attention(q, kv, meta, scale=0.2))
    q, kv, meta = _batch([(700, 3), (20, 2)], 1, 2, 32, seed=7)
    got = paged_prefill_attention(
        q, kv, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len, 0.2, 40,
        block_m=16, block_n=16,
    )  # fmt: skip
    _close(got, REF.prefill_attention(q, kv, meta, scale=0.2))


# One launch: each (seq, KV head)'s last split to finish weighs every used split. Ragged lengths: a 1-token
# sequence (one used split of 7), lengths one short of / at a tile boundary, and one over many tiles.
ONE_LAUNCH_MIX = [(0, 1), (31, 1), (32, 1), (150, 1), (299, 1)]


@pytest.mark.parametrize(("group", "head_dim", "n_kv"), GQA_SHAPES)
@pytest.mark.parametrize("num_splits", [1, 2, 7])
def test_one_launch_decode_matches_reference(group: int, head_dim: int, n_kv: int, num_splits: int) -> None:
    q, kv, meta = _batch(ONE_LAUNCH_MIX, n_kv, group, head_dim, seed=40 + group)
    want = REF.decode_attention(q, kv, meta, scale=head_dim**-0.5)
    args = (q, kv, meta.block_tables, meta.seq_lens, head_dim**-0.5, num_splits)
    got = paged_decode_attention(*args, block_n=32, one_launch=True)
    _close(got, want)
    # every ticket counter is back at 0, so the next launch (a CUDA graph's next replay) counts from 0
    assert not decode_tickets(q.device).any()
    again = paged_decode_attention(*args, block_n=32, one_launch=True)
    assert torch.equal(got, again)


def test_one_launch_weighs_splits_past_one_chunk() -> None:
    # 40 splits of 32 keys over 1,300 tokens: the reducing program walks the used splits several chunks
    # at a time (8 query heads a KV head, head dim 128: 4 splits a chunk at 4 warps)
    q, kv, meta = _batch([(1299, 1), (0, 1), (100, 1)], 2, 8, 128, seed=41)
    got = paged_decode_attention(
        q, kv, meta.block_tables, meta.seq_lens, 0.09, 40, block_n=32, one_launch=True
    )
    _close(got, REF.decode_attention(q, kv, meta, scale=0.09))
    assert not decode_tickets(q.device).any()


def test_decode_picks_one_launch_and_its_tile_as_measured() -> None:
    # a 16-bit cache: one launch at every split count; FP8: four warps over 64 keys at 16+ splits (a batch of
    # a few sequences), else one warp over 16, whose reducer is slow past 32 partial rows (group x splits)
    assert decode_tile(False, 32) == decode_tile(False, 2) == (64, 4, 3)
    assert decode_tile(True, 32) == decode_tile(True, 16) == (64, 4, 3)
    assert decode_tile(True, 9) == decode_tile(True, 2) == (16, 1, 5)
    assert all(choose_one_launch(g, s, 4) for g in (1, 4, 8) for s in (1, 2, 5, 17, 32, 64))
    assert choose_one_launch(4, 5, 1) and choose_one_launch(8, 3, 1) and choose_one_launch(4, 2, 1)
    assert not choose_one_launch(4, 9, 1) and not choose_one_launch(8, 9, 1)
    # by default paged_decode_attention follows the rule: here one launch (the same bits as forced)
    q, kv, meta = _batch(ONE_LAUNCH_MIX, 2, 4, 64, seed=43)
    args = (q, kv, meta.block_tables, meta.seq_lens, 0.125, 7)
    assert torch.equal(paged_decode_attention(*args), paged_decode_attention(*args, one_launch=True))


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_one_launch_reads_an_fp8_cache(q_dtype: torch.dtype) -> None:
    q, kv, meta = _batch(ONE_LAUNCH_MIX, 2, 4, 64, dtype=q_dtype, seed=42, kv_dtype=FP8)
    got = paged_decode_attention(
        q, kv, meta.block_tables, meta.seq_lens, 0.125, 5, block_n=32, one_launch=True
    )
    _close(got, REF.decode_attention(q, kv, meta, scale=0.125))
    assert not decode_tickets(q.device).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_half_precision_cache(dtype: torch.dtype) -> None:
    q, kv, meta = _batch([(37, 1), (0, 1), (80, 1)], 2, 4, 64, dtype=dtype, seed=6)
    got = paged_decode_attention(q, kv, meta.block_tables, meta.seq_lens, 0.125, 2, block_n=16)
    _close(got, REF.decode_attention(q, kv, meta, scale=0.125))


# Varlen: plain prompt, 1-token prompt, cached prefix ending mid-block, prefix on a block boundary,
# a 1-token chunk after a prefix, and a chunk that crosses several query tiles.
PREFILL_MIX = [(0, 20), (0, 1), (7, 25), (16, 17), (40, 1), (5, 40)]


@pytest.mark.parametrize(("group", "head_dim", "n_kv"), GQA_SHAPES)
def test_prefill_matches_reference_on_varlen_batch(group: int, head_dim: int, n_kv: int) -> None:
    q, kv, meta = _batch(PREFILL_MIX, n_kv, group, head_dim, seed=10 + group)
    want = REF.prefill_attention(q, kv, meta, scale=head_dim**-0.5)
    got = paged_prefill_attention(
        q, kv, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len,
        head_dim**-0.5, block_m=16, block_n=16,
    )  # fmt: skip
    _close(got, want)


def test_prefill_through_ops_default_tiles() -> None:
    q, kv, meta = _batch([(70, 30), (0, 3), (3, 66)], 2, 3, 64, block_size=8, seed=20)
    _close(TRI.prefill_attention(q, kv, meta, scale=0.125), REF.prefill_attention(q, kv, meta, scale=0.125))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_prefill_half_precision_cache(dtype: torch.dtype, num_splits: int) -> None:
    q, kv, meta = _batch([(9, 12), (0, 1), (16, 20)], 2, 4, 64, dtype=dtype, seed=21)
    got = paged_prefill_attention(
        q, kv, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len, 0.125,
        num_splits, block_m=16, block_n=16,
    )  # fmt: skip
    _close(got, REF.prefill_attention(q, kv, meta, scale=0.125))


# Split-K prefill: a few new tokens over a long cached prefix (ending mid-block), two tiles whose first
# one ends inside the context's last key tile, a plain prompt whose second tile crosses the causal edge,
# a 1-token chunk, and one short enough that most splits are empty.
SPLIT_MIX = [(300, 3), (150, 17), (0, 20), (47, 1), (5, 2)]


@pytest.mark.parametrize(("group", "head_dim", "n_kv"), [(1, 32, 2), (4, 32, 1), (3, 64, 2)])
@pytest.mark.parametrize("num_splits", [2, 5])
def test_prefill_split_matches_reference(group: int, head_dim: int, n_kv: int, num_splits: int) -> None:
    q, kv, meta = _batch(SPLIT_MIX, n_kv, group, head_dim, seed=30 + group)
    want = REF.prefill_attention(q, kv, meta, scale=head_dim**-0.5)
    got = paged_prefill_attention(
        q, kv, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len,
        head_dim**-0.5, num_splits, block_m=16, block_n=16,
    )  # fmt: skip
    _close(got, want)


def test_prefill_through_ops_splits_a_short_suffix_over_a_long_context() -> None:
    # 2 query heads x 1 sequence x 1 tile is fewer programs than the interpreter's 4 SMs: 2 splits.
    q, kv, meta = _batch([(1100, 5)], 1, 2, 32, seed=31)
    assert choose_prefill_splits(2, 1, 5, 1105, 4) == 2
    _close(TRI.prefill_attention(q, kv, meta, scale=0.2), REF.prefill_attention(q, kv, meta, scale=0.2))


def test_choose_prefill_splits_only_for_short_queries_over_long_contexts() -> None:
    assert choose_prefill_splits(32, 1, 16, 16400, 132) == 17  # a fetched 16k prefix, 16-token suffix
    assert choose_prefill_splits(32, 1, 200, 16400, 132) == 5  # 4 tiles: 128 programs
    assert choose_prefill_splits(8, 1, 16, 40000, 132) == 64
    assert choose_prefill_splits(32, 1, 4096, 4096, 132) == 1  # a normal prefill fills the SMs
    assert choose_prefill_splits(32, 5, 16, 16400, 132) == 1
    assert choose_prefill_splits(32, 1, 16, 1000, 132) == 1  # short context
    assert choose_prefill_splits(32, 1, 16, 16, 132) == 1


def test_choose_num_splits_keeps_long_contexts_parallel() -> None:
    # a 16-bit cache: at most four programs per SM (H200, 132 SMs: 528), as graphs at 8,192 keys pick them
    assert choose_num_splits(64, 8, 4096, 132) == choose_num_splits(128, 4, 8192, 132) == 1
    assert choose_num_splits(64, 4, 8192, 132) == choose_num_splits(32, 8, 8192, 132) == 2
    assert choose_num_splits(32, 4, 8192, 132) == 4 and choose_num_splits(8, 4, 8192, 132) == 16
    # an FP8 cache: at least four one-warp programs per SM
    assert choose_num_splits(64, 8, 4096, 132, kv_fp8=True) == 2
    assert choose_num_splits(64, 4, 8192, 132, kv_fp8=True) == 3
    assert choose_num_splits(1, 8, 32768, 132) == 64
    assert choose_num_splits(1, 8, 300, 132) == 2
    assert choose_num_splits(256, 8, 100, 132) == 1


def test_boundary_checks_name_the_bad_value() -> None:
    q, kv, meta = _batch([(3, 1)], 2, 2, 64)
    bad_tables = dataclasses.replace(meta, block_tables=meta.block_tables.long())
    with pytest.raises(AssertionError, match=r"block_tables must be torch.int32"):
        TRI.decode_attention(q, kv, bad_tables, 0.125)
    with pytest.raises(AssertionError, match=r"query heads 3 must be a multiple of KV heads 2"):
        TRI.decode_attention(torch.randn(1, 3, 64), kv, meta, 0.125)
    with pytest.raises(AssertionError, match=r"kv_layer must be contiguous"):
        TRI.decode_attention(q, kv.transpose(3, 4).contiguous().transpose(3, 4), meta, 0.125)
    with pytest.raises(AssertionError, match=r"block_ids must lie in \[0, 4\)"):
        TRI.gather_blocks(kv, torch.tensor([4]), torch.empty(2, 1, 16, 2, 64))
    with pytest.raises(AssertionError, match=r"q must have a contiguous head dim"):
        TRI.prefill_attention(torch.randn(1, 64, 2).transpose(1, 2), kv, meta, 0.125)


FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_reads_an_fp8_cache_as_the_reference_does(q_dtype: torch.dtype, num_splits: int) -> None:
    # the cache holds FP8 bytes; both widen them to q's dtype (scale 1.0) and compute in it
    q, kv, meta = _batch([(0, 1), (15, 1), (150, 1)], 2, 4, 64, dtype=q_dtype, seed=30, kv_dtype=FP8)
    assert kv.dtype == FP8 and kv.element_size() == 1
    want = REF.decode_attention(q, kv, meta, scale=0.125)
    got = paged_decode_attention(q, kv, meta.block_tables, meta.seq_lens, 0.125, num_splits, block_n=32)
    _close(got, want)
    _close(TRI.decode_attention(q, kv, meta, scale=0.125), want)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_prefill_reads_an_fp8_cache_as_the_reference_does(q_dtype: torch.dtype, num_splits: int) -> None:
    q, kv, meta = _batch(PREFILL_MIX, 2, 3, 64, dtype=q_dtype, seed=31, kv_dtype=FP8)
    got = paged_prefill_attention(
        q, kv, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len, 0.125,
        num_splits, block_m=16, block_n=16,
    )  # fmt: skip
    _close(got, REF.prefill_attention(q, kv, meta, scale=0.125))


def test_fp8_attention_is_close_to_the_unquantized_cache() -> None:
    # what FP8 costs: the same K/V in fp32 and rounded to FP8 give outputs within e4m3's rounding
    q, kv, meta = _batch([(40, 1), (200, 1)], 2, 4, 64, seed=32)
    kv8 = kv.to(FP8)
    exact = REF.decode_attention(q, kv, meta, scale=0.125)
    got = TRI.decode_attention(q, kv8, meta, scale=0.125)
    err = (got - exact).abs()
    assert err.max() < 0.1 and err.mean() < 0.01, (err.max(), err.mean())


@pytest.mark.parametrize("head_dim", [64, 3])  # moved as int64 words; 3 bytes a head: as bytes
def test_fp8_blocks_gather_and_scatter_as_bytes(head_dim: int) -> None:
    gen = torch.Generator().manual_seed(33)
    kv = torch.randn(2, 10, 16, 3, head_dim, generator=gen).to(FP8)
    ids = torch.tensor([7, 2, 9, 0], dtype=torch.int64)
    out_tri = torch.empty(2, 4, 16, 3, head_dim, dtype=FP8)
    out_ref = torch.empty(2, 4, 16, 3, head_dim, dtype=FP8)
    TRI.gather_blocks(kv, ids, out_tri)
    REF.gather_blocks(kv, ids, out_ref)
    assert torch.equal(out_tri.view(torch.uint8), out_ref.view(torch.uint8))
    assert torch.equal(out_tri.view(torch.uint8), kv[:, ids].view(torch.uint8))
    dst_tri, dst_ref = torch.zeros_like(kv), torch.zeros_like(kv)
    TRI.scatter_blocks(out_tri, dst_tri, ids)
    REF.scatter_blocks(out_ref, dst_ref, ids)
    assert torch.equal(dst_tri.view(torch.uint8), dst_ref.view(torch.uint8))
    assert torch.equal(dst_tri[:, ids].view(torch.uint8), kv[:, ids].view(torch.uint8))


@pytest.mark.parametrize(
    ("dtype", "head_dim"), [(torch.bfloat16, 64), (torch.float32, 64), (FP8, 64), (FP8, 3)]
)
def test_scatter_layers_writes_a_frame_of_layers_in_one_launch(
    dtype: torch.dtype, head_dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DATA frame of several layers lands in the layer-stacked cache with one block copy, not one per layer
    (each launch costs the receiving host its Python and launch time, whatever the bytes), and bit for bit
    where the reference puts it; the layers outside the frame stay untouched."""
    from pdserve.kernels import triton_ops

    gen = torch.Generator().manual_seed(41)
    kv = torch.randn(5, 2, 10, 16, 3, head_dim, generator=gen).to(dtype)  # [L, 2, N, B, H, D]
    src = torch.randn(3, 2, 4, 16, 3, head_dim, generator=gen).to(dtype)  # layers 1..3 of blocks ids
    ids = torch.tensor([7, 2, 9, 0], dtype=torch.int64)
    launches: list[torch.Size] = []
    copy = triton_ops._copy_blocks

    def counted(src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor, gather: bool) -> None:
        launches.append(src.shape)
        copy(src, dst, ids, gather)

    monkeypatch.setattr(triton_ops, "_copy_blocks", counted)
    dst_tri, dst_ref = kv.clone(), kv.clone()
    TRI.scatter_layers(src, dst_tri[1:4], ids)
    REF.scatter_layers(src, dst_ref[1:4], ids)
    assert len(launches) == 1
    assert torch.equal(dst_tri.view(torch.uint8), dst_ref.view(torch.uint8))
    assert torch.equal(dst_tri[1:4, :, ids].view(torch.uint8), src.view(torch.uint8))
    for layer in (0, 4):
        assert torch.equal(dst_tri[layer].view(torch.uint8), kv[layer].view(torch.uint8))
