"""Triton paged attention kernels: split-K decode with GQA, and varlen causal prefill over paged KV.

Both read K/V through the block table (token n of a sequence lives in block `table[n // block_size]` at
offset `n % block_size`), page-granular: a tile's in-page offsets are computed once, and each tile adds
its rows' page bases from one table load; tiles start at multiples of BLOCK_N (both powers of two), so a
tile covers whole pages or lies inside one, and tables need not be contiguous. Softmax runs in base 2 on
fp32 scores with fp32 accumulation whatever the cache dtype. An FP8 cache (KV_FP8; kernels/ops.py: scale
1.0) is widened in registers as each tile is loaded, to fp16 beside a bf16/fp16 q (exact for e4m3), and q
and P are rounded to fp16 too: 3 more bits than the bf16 the reference computes in, so the kernel is the
closer of the two to attention in fp32 on the same FP8 values (tests/test_fp8_gpu.py measures both).
Launchers take already-checked tensors (kernels/triton_ops.py checks them) and never synchronise with the
device, so decode can be captured in a CUDA graph. The decode split kernel and the split reduction launch
with programmatic dependent launch where the device has it and keep kernels/pdl.py's invariants: each
program waits first, before any early return (q, the sequence lengths, the block tables and the cache all
come from the step or the kernels before it).

Split-K, both phases: when too few programs would cover the SMs, each sequence's keys are cut into
`num_splits` BLOCK_N-aligned ranges, one program each; a split writes its normalised output and base-2
log-sum-exp per (query row, head) into fp32 scratch [rows, Hq, splits, (D)], and a reduction weighs them:
prefill's in a second kernel (`_reduce_splits_kernel`); decode's, where `choose_one_launch` says (every
16-bit cache; FP8 but for a one-warp program over many partials), in the split kernel's own launch: each
used split of a (seq, KV head) stores its partials and takes a ticket from that pair's int32 counter
(`decode_tickets`, acq_rel at GPU scope after a barrier), and the one that draws the last ticket weighs
the used splits in split order (the same bits whichever program it is) and sets the counter back to 0, so
every counter is 0 between launches and a CUDA graph replays from 0; one split stores its output itself.
Split 0 always holds key 0, which every query sees, so each row has a finite lse to weigh the others
against; a split with no key visible to a row has lse = -inf and weight 0. Compiled kernels: prefill
takes its split count at run time (Triton does not specialize on it), so it compiles twice (split or
single pass) whatever the count, where a constant compiled one per count on first use, seconds of stall
inside a request, up to 64 times; the reduction compiles once per power of two up to 16 (it weighs 16
splits at a time past that); decode keeps its count a constant, as before: decode runs from CUDA graphs
captured at start-up, one count per batch bucket, so no request meets its compile. The split counts:
- decode (`choose_num_splits`): a 16-bit cache, the most splits whose (seq, KV head, split) programs are
  at most four per SM; an FP8 cache (one-warp programs, many resident at once), at least four per SM; no
  split under 256 keys either way. Measured on an H200 (benchmarks/attention_sweep.py) at 2k context, 8 and
  4 KV heads (Llama-3.1-8B at TP=1 and 2), batch 8 to 128: this count was the fastest tried, or within
  2 % of it, every time, where the rounded-up count left a partly filled second round (TP=2 batch 64: 3
  splits, 768 programs, 76.4 us a layer; 2 splits, 512 programs, 68.9; TP=1 batch 64: 131.7 -> 128.2).
  A graph captured at max_model_len 8,192 cuts batch 1 into 32 splits, which a 1.2k context fills 19 of,
  one 64-key tile each: the fastest of 16, 32 and 64 splits and of 16-, 32- and 64-key tiles at 8 and 4
  KV heads (7.5 and 6.1 us a layer).
- prefill (`choose_prefill_splits`): only when (Hq x seqs x query tiles) programs are fewer than the SMs
  (a short suffix over a long cached prefix: 32 programs for 16 new tokens at Llama-3.1-8B), then about
  four programs per SM, no split under 512 keys; so a normal prefill (enough tiles to fill the SMs) or a
  context under 1,024 keys keeps the single pass that writes its output directly, and the scratch stays
  under (4 x SMs + programs) x BLOCK_M x D fp32 values (21 MiB on an H100 at D = 128).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from pdserve.kernels.pdl import pdl_launch, pdl_wait

LOG2E = 1.4426950408889634
# Finite start for the running max, so a fully masked tile never computes exp2(-inf - -inf) = NaN.
_MASKED_MAX = tl.constexpr(-1.0e30)
_MAX_SPLITS = 64
_MIN_PREFILL_SPLIT = 512  # keys
_SPLITS_CHUNK = 16  # the most splits the reduction weighs at a time (fewer: the next power of two)
_MAX_TICKETS = 1 << 16  # (seq, KV head) pairs of a one-launch decode; one int32 ticket counter each
_REDUCE_VALUES_PER_THREAD = 32  # fp32 partial values a thread of a one-launch reducer loads per chunk
# Decode tile (keys per tile, num_warps, num_stages) by KV_FP8, measured at batch 64 x 4k context on an
# H200 (docs/benchmarks.md). FP8: one warp over 16 keys, 5 stages (four K/V buffers in flight, the table
# load a tile ahead): its query rows fit one MMA tile, so the softmax needs no cross-warp reduction
# through shared memory and no barrier, and the 1,024 programs at 2 splits are all resident at once (162
# registers, 24 KiB of shared memory each; 32 keys at 4 stages take 36 KiB, so 6 an SM, two rounds).
_DECODE_TILES = {False: (64, 4, 3), True: (16, 1, 5)}
# FP8 at _FP8_WIDE_SPLITS splits or more (a batch of a few sequences: few programs, each one tile or two):
# four warps over 64 keys, as a 16-bit cache; with the one-launch reduction 6.3 us against 8.2 for one warp
# and two launches at batch 1 x 1.2k, Llama-3.1-8B shape, H200 (docs/benchmarks.md).
_FP8_WIDE_TILE = (64, 4, 3)
_FP8_WIDE_SPLITS = 16
# A one-warp reducer weighs at most this many partial rows (query heads of a KV head x splits, both padded
# to powers of two) in one launch; more take the second launch (H200: 4 x 16 rows 20.4 us one / 20.2 two,
# 8 x 16 rows 22.0 / 21.1, 4 x 8 rows 31.1 / 32.4).
_ONE_WARP_REDUCE_ROWS = 32


@triton.jit
def _in_page(offs_n, kv_head, offs_d, stride_kt, stride_kh, BLOCK_SIZE: tl.constexpr):
    # [N, D] offsets of a tile's rows inside their pages, for one KV head: the same for every tile, so
    # the loops compute them once (page-granular addressing)
    return (offs_n % BLOCK_SIZE)[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]


@triton.jit
def _pages(table_row_ptr, n0, offs_n, n_mask, BLOCK_SIZE: tl.constexpr):
    # [N] int64 page (block) of each of tokens n0 + offs_n of one sequence, from its block-table row; 0
    # outside n_mask
    return tl.load(table_row_ptr + (n0 + offs_n) // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)


@triton.jit
def _tile_offsets(page, n0, in_page, stride_kb, stride_kt, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    # [N, D] element offsets of tokens n0 + offs_n (n0 a multiple of BLOCK_N) on pages `page`: each row's
    # page base plus its in-page offset. Both are powers of two, so a tile either starts on a page boundary
    # (BLOCK_N >= BLOCK_SIZE) or lies inside one page at offset n0 % BLOCK_SIZE.
    if BLOCK_N < BLOCK_SIZE:
        in_page += (n0 % BLOCK_SIZE) * stride_kt
    return page[:, None] * stride_kb + in_page


@triton.jit
def _kv_offsets(
    table_row_ptr, n0, offs_n, n_mask, in_page, stride_kb, stride_kt, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    # [N, D] element offsets of tokens n0 + offs_n of one sequence, their pages read from the block table
    page = _pages(table_row_ptr, n0, offs_n, n_mask, BLOCK_SIZE)
    return _tile_offsets(page, n0, in_page, stride_kb, stride_kt, BLOCK_SIZE, BLOCK_N)


@triton.jit
def _load_kv(
    k_ptr, v_ptr, table_row_ptr, n0, offs_n, n_mask, d_mask, in_page, stride_kb, stride_kt,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # K and V tiles [N, D] of tokens n0 + offs_n of one sequence and KV head; 0 outside n_mask x d_mask
    off = _kv_offsets(table_row_ptr, n0, offs_n, n_mask, in_page, stride_kb, stride_kt, BLOCK_SIZE, BLOCK_N)
    kv_mask = n_mask[:, None] & d_mask[None, :]
    return tl.load(k_ptr + off, mask=kv_mask, other=0.0), tl.load(v_ptr + off, mask=kv_mask, other=0.0)


@triton.jit
def _widen_v(v, DOT_DTYPE: tl.constexpr, KV_FP8: tl.constexpr, ASM_CVT: tl.constexpr):
    # V in DOT_DTYPE. Compiled, an FP8 tile bound for fp16 dots is widened by cvt.rn.f16x2.e4m3x2 (sm_89+,
    # 2 values an instruction, exact) through an asm block the compiler may not move: with a plain cast it
    # moves the shared-memory transpose P @ V needs ahead of the widening, onto the FP8 bytes, and reads
    # them one byte per load (no 8-bit ldmatrix.trans), which bounds the kernel well below HBM. The
    # interpreter runs no asm, and fp32 dots (beside an fp32 q) take no fp16: there a cast.
    if KV_FP8 and ASM_CVT and DOT_DTYPE == tl.float16:  # noqa: SIM300 (ruff takes tl.float16 for a constant)
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
            "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [v], dtype=tl.float16, is_pure=False, pack=4,
        )  # fmt: skip
    return v.to(DOT_DTYPE)


@triton.jit
def _softmax_step(
    q, k, v, valid, m_i, l_i, acc, qk_scale, APPLY_MASK: tl.constexpr, DOT_DTYPE: tl.constexpr,
    KV_FP8: tl.constexpr, ASM_CVT: tl.constexpr,
):  # fmt: skip
    # q: [M, D] DOT_DTYPE; k, v: [N, D] cache dtype; valid: [M, N]; m_i, l_i: [M]; acc: [M, D] fp32
    s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision="ieee") * qk_scale
    if APPLY_MASK:
        s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # P is rounded to the cache dtype before P @ V, as the reference does (an FP8 cache: to DOT_DTYPE).
    p_r = p.to(DOT_DTYPE) if KV_FP8 else p.to(v.dtype).to(DOT_DTYPE)
    pv = tl.dot(p_r, _widen_v(v, DOT_DTYPE, KV_FP8, ASM_CVT), input_precision="ieee")
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _round_q(q, k_ptr, DOT_DTYPE: tl.constexpr, KV_FP8: tl.constexpr):
    # q rounded as the reference rounds it: to the cache dtype; for an FP8 cache to DOT_DTYPE (fp16 for a
    # bf16/fp16 q: exact for a bf16 value in fp16's normal range, saturated past +-65504 rather than inf)
    if KV_FP8:
        if DOT_DTYPE == tl.float16:  # noqa: SIM300 (ruff takes tl.float16 for a constant)
            q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0)
        return q.to(DOT_DTYPE)
    return q.to(k_ptr.dtype.element_ty).to(DOT_DTYPE)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, mid_o_ptr, mid_lse_ptr, out_ptr, tickets_ptr, qk_scale,
    stride_qs, stride_qh, stride_kb, stride_kt, stride_kh, stride_ts, stride_os, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_DTYPE: tl.constexpr,
    KV_FP8: tl.constexpr, ASM_CVT: tl.constexpr, ONE_LAUNCH: tl.constexpr, GROUP_R: tl.constexpr,
    SPLITS_PAD: tl.constexpr, R_CHUNK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # ONE_LAUNCH: the last used split of a (seq, KV head) to finish weighs them all into out (tickets_ptr:
    # one int32 counter per (seq, KV head), 0 before and after); else partials only, for
    # _reduce_splits_kernel (out_ptr and tickets_ptr unused).
    pdl_wait(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Each split takes a BLOCK_N-aligned share of this sequence's own length: a grid sized for the
    # batch's longest context stays correct for shorter ones (and for a graph captured at a larger one).
    per_split = tl.maximum(tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N, BLOCK_N)
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    used = tl.cdiv(seq_len, per_split)  # splits holding a key; the later ones are empty
    if ONE_LAUNCH and split >= used:
        return  # nothing to weigh: the reducing program reads only the used splits

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, DIM_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q_mask = (offs_g < GROUP)[:, None] & d_mask[None, :]
    # q: [GROUP_PAD, DIM_PAD], every query head of this KV head, so K/V are read once per group
    q = tl.load(
        q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :], mask=q_mask, other=0.0
    )
    q = _round_q(q, k_ptr, DOT_DTYPE, KV_FP8)

    m_i = tl.full([GROUP_PAD], _MASKED_MAX, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    table_row = tables_ptr + seq.to(tl.int64) * stride_ts
    in_page = _in_page(offs_n, kv_head, offs_d, stride_kt, stride_kh, BLOCK_SIZE)
    if KV_FP8:
        # The block-table load one tile ahead (`page` carried over): the pipeliner then gives K/V every
        # stage, num_stages - 1 buffers in flight, where a table load in the loop takes a stage and leaves
        # num_stages - 3 (one at 4 stages: each tile's wait covered none of its latency). A 16-bit cache
        # keeps the load in the loop: its wider buffers in every stage cost more in occupancy than they
        # gain (docs/benchmarks.md).
        page = _pages(table_row, start, offs_n, start + offs_n < end, BLOCK_SIZE)
        for n0 in range(start, end, BLOCK_N):
            n_mask = n0 + offs_n < end
            off = _tile_offsets(page, n0, in_page, stride_kb, stride_kt, BLOCK_SIZE, BLOCK_N)
            page = _pages(table_row, n0 + BLOCK_N, offs_n, n0 + BLOCK_N + offs_n < end, BLOCK_SIZE)
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(k_ptr + off, mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + off, mask=kv_mask, other=0.0)
            m_i, l_i, acc = _softmax_step(
                q, k, v, n_mask[None, :], m_i, l_i, acc, qk_scale, True, DOT_DTYPE, KV_FP8, ASM_CVT
            )
    else:
        for n0 in range(start, end, BLOCK_N):
            n_mask = n0 + offs_n < end
            k, v = _load_kv(k_ptr, v_ptr, table_row, n0, offs_n, n_mask, d_mask, in_page, stride_kb,
                            stride_kt, BLOCK_SIZE, BLOCK_N)  # fmt: skip
            m_i, l_i, acc = _softmax_step(
                q, k, v, n_mask[None, :], m_i, l_i, acc, qk_scale, True, DOT_DTYPE, KV_FP8, ASM_CVT
            )

    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    if ONE_LAUNCH and NUM_SPLITS == 1:  # the whole context in this program: the output, no partials
        out_off = seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + out_off, o, mask=q_mask)
        return
    # Partial result per (seq, head, split): normalised output and log2-sum-exp; an empty split has
    # lse = -inf and so weight 0 in the reduction.
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
    row = seq.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads  # mid_*: [S, Hq, NUM_SPLITS, (D)]
    tl.store(mid_lse_ptr + row * NUM_SPLITS + split, lse, mask=offs_g < GROUP)
    o_off = (row[:, None] * NUM_SPLITS + split) * HEAD_DIM + offs_d[None, :]
    tl.store(mid_o_ptr + o_off, o, mask=q_mask)
    if ONE_LAUNCH:
        _reduce_if_last(mid_o_ptr, mid_lse_ptr, out_ptr, tickets_ptr, seq, kv_head, used, stride_os,
                        stride_oh, GROUP, HEAD_DIM, DIM_PAD, NUM_SPLITS, GROUP_R, SPLITS_PAD,
                        R_CHUNK)  # fmt: skip


@triton.jit
def _reduce_if_last(
    mid_o_ptr, mid_lse_ptr, out_ptr, tickets_ptr, seq, kv_head, used, stride_os, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
    GROUP_R: tl.constexpr, SPLITS_PAD: tl.constexpr, R_CHUNK: tl.constexpr,
):  # fmt: skip
    # After this program stored its partials: the barrier orders every thread's stores before the ticket,
    # whose acq_rel atomic (GPU scope) publishes them and, for the last of the `used` splits to arrive,
    # acquires the others'. That one weighs splits 0..used-1 in split order (the same bits whichever split
    # is last; .cg reads L2, never a stale L1 line of an earlier launch) and sets the counter back to 0 for
    # the next launch. Under the interpreter programs run one after another: the last one reduces.
    tl.debug_barrier()
    ticket_ptr = tickets_ptr + seq * tl.num_programs(1) + kv_head
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    if ticket == used - 1:
        offs_g = tl.arange(0, GROUP_R)
        offs_s = tl.arange(0, SPLITS_PAD)
        offs_c = tl.arange(0, R_CHUNK)
        offs_d = tl.arange(0, DIM_PAD)
        g_mask = offs_g < GROUP
        d_mask = offs_d < HEAD_DIM
        heads = kv_head * GROUP + offs_g
        row = seq.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads  # [GROUP_R], as the partials' rows
        lse_mask = g_mask[:, None] & (offs_s < used)[None, :]
        lse = tl.load(mid_lse_ptr + row[:, None] * NUM_SPLITS + offs_s[None, :], mask=lse_mask,
                      other=float("-inf"), cache_modifier=".cg")  # fmt: skip
        m = tl.where(g_mask, tl.max(lse, 1), 0.0)  # finite: split 0 holds key 0
        w_sum = tl.where(g_mask, tl.sum(tl.exp2(lse - m[:, None]), 1), 1.0)  # padded heads: not 0 / 0
        acc = tl.zeros([GROUP_R, DIM_PAD], tl.float32)
        # R_CHUNK splits at a time, unrolled and masked (no branch), so the loads of every chunk can be
        # in flight together
        for c in tl.static_range(SPLITS_PAD // R_CHUNK):
            s = c * R_CHUNK + offs_c
            c_mask = g_mask[:, None] & (s < used)[None, :]  # [GROUP_R, R_CHUNK]
            part = row[:, None] * NUM_SPLITS + s[None, :]
            w = tl.exp2(tl.load(mid_lse_ptr + part, mask=c_mask, other=float("-inf"), cache_modifier=".cg")
                        - m[:, None])  # fmt: skip
            o_off = (part * HEAD_DIM)[:, :, None] + offs_d[None, None, :]
            o_mask = c_mask[:, :, None] & d_mask[None, None, :]
            o = tl.load(mid_o_ptr + o_off, mask=o_mask, other=0.0, cache_modifier=".cg")
            acc += tl.sum(w[:, :, None] * o, 1)
        out_off = seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + out_off, acc / w_sum[:, None], mask=g_mask[:, None] & d_mask[None, :])
        tl.store(ticket_ptr, 0)


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_splits_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr, stride_or, stride_oh, num_splits,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, SPLITS_CHUNK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(PDL)
    # Grid (R, Hq): R = sequences (decode, one query each) or query tokens (prefill).
    # mid_o: [R, Hq, num_splits, HEAD_DIM] fp32, mid_lse: [R, Hq, num_splits] fp32; out: [R, Hq, HEAD_DIM].
    # The splits are weighed SPLITS_CHUNK at a time with a running max, so one compiled kernel serves
    # every split count. Split 0 (in the first chunk) always holds key 0, visible to every query, so the
    # running max is finite from the first chunk on.
    r = tl.program_id(0)
    head = tl.program_id(1)
    row = r.to(tl.int64) * tl.num_programs(1) + head
    offs_s = tl.arange(0, SPLITS_CHUNK)
    offs_d = tl.arange(0, DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    s_mask = offs_s < num_splits
    lse = tl.load(mid_lse_ptr + row * num_splits + offs_s, mask=s_mask, other=float("-inf"))
    m_run = tl.max(lse, 0)
    w = tl.exp2(lse - m_run)  # [SPLITS_CHUNK]
    o_off = (row * num_splits + offs_s[:, None]) * HEAD_DIM + offs_d[None, :]
    o = tl.load(mid_o_ptr + o_off, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    acc = tl.sum(w[:, None] * o, 0)  # [DIM_PAD]
    w_sum = tl.sum(w, 0)
    for s0 in range(SPLITS_CHUNK, num_splits, SPLITS_CHUNK):
        s = s0 + offs_s
        s_mask = s < num_splits
        lse = tl.load(mid_lse_ptr + row * num_splits + s, mask=s_mask, other=float("-inf"))
        m_new = tl.maximum(m_run, tl.max(lse, 0))
        rescale = tl.exp2(m_run - m_new)
        w = tl.exp2(lse - m_new)
        o_off = (row * num_splits + s[:, None]) * HEAD_DIM + offs_d[None, :]
        o = tl.load(mid_o_ptr + o_off, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
        acc = acc * rescale + tl.sum(w[:, None] * o, 0)
        w_sum = w_sum * rescale + tl.sum(w, 0)
        m_run = m_new
    tl.store(out_ptr + r.to(tl.int64) * stride_or + head * stride_oh + offs_d, acc / w_sum, mask=d_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, mid_o_ptr, mid_lse_ptr, tables_ptr, seq_lens_ptr, query_start_ptr, qk_scale,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_ts, stride_ot, stride_oh, num_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DOT_DTYPE: tl.constexpr,
    KV_FP8: tl.constexpr, ASM_CVT: tl.constexpr,
):  # fmt: skip
    # Grid (num_splits * Hq, S, tiles): the heads of one split side by side, so a KV group's blocks are
    # shared in L2. SPLIT: num_splits > 1 (partials to mid_*), else the single pass writes out directly.
    n_heads = tl.num_programs(0) // num_splits
    head = tl.program_id(0) % n_heads
    split = tl.program_id(0) // n_heads
    seq = tl.program_id(1)
    # Longest-running (last) query tiles start first.
    tile = tl.num_programs(2) - 1 - tl.program_id(2)
    q_begin = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_begin
    m0 = tile * BLOCK_M
    if m0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # cached prefix plus earlier chunks, already in the paged cache
    kv_head = head // GROUP

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, DIM_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM
    m_mask = offs_m < q_len
    q_mask = m_mask[:, None] & d_mask[None, :]
    rows = (q_begin + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=q_mask, other=0.0
    )
    q = _round_q(q, k_ptr, DOT_DTYPE, KV_FP8)  # q: [BLOCK_M, DIM_PAD]
    q_pos = ctx_len + offs_m

    m_i = tl.full([BLOCK_M], _MASKED_MAX, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    table_row = tables_ptr + seq.to(tl.int64) * stride_ts
    # The tile never reads keys past its last row's position: [0, visible_end). Keys before the tile's
    # first query position, [0, unmasked_end), are visible to every row: no causal mask there.
    visible_end = tl.minimum(ctx_len + m0 + BLOCK_M, seq_len)
    unmasked_end = (ctx_len + m0) // BLOCK_N * BLOCK_N
    if not SPLIT:  # the single pass, as compiled before splits existed
        start = 0
        unmasked_stop = unmasked_end
        masked_start = unmasked_end
        end = visible_end
    else:
        # This split's BLOCK_N-aligned share [start, end), split 0 from key 0. Every bound is aligned or
        # is visible_end, past which every key is causally masked anyway, so no split mask is needed.
        per_split = tl.cdiv(tl.cdiv(visible_end, num_splits), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = tl.minimum(start + per_split, visible_end)
        unmasked_stop = tl.minimum(end, unmasked_end)
        masked_start = tl.maximum(start, unmasked_end)
    all_n = offs_n >= 0
    in_page = _in_page(offs_n, kv_head, offs_d, stride_kt, stride_kh, BLOCK_SIZE)
    for n0 in range(start, unmasked_stop, BLOCK_N):
        off = _kv_offsets(table_row, n0, offs_n, all_n, in_page, stride_kb, stride_kt, BLOCK_SIZE, BLOCK_N)
        k = tl.load(k_ptr + off, mask=d_mask[None, :], other=0.0)
        v = tl.load(v_ptr + off, mask=d_mask[None, :], other=0.0)
        m_i, l_i, acc = _softmax_step(
            q, k, v, all_n[None, :], m_i, l_i, acc, qk_scale, False, DOT_DTYPE, KV_FP8, ASM_CVT
        )
    for n0 in range(masked_start, end, BLOCK_N):
        n = n0 + offs_n
        n_mask = n < seq_len
        k, v = _load_kv(k_ptr, v_ptr, table_row, n0, offs_n, n_mask, d_mask, in_page, stride_kb, stride_kt,
                        BLOCK_SIZE, BLOCK_N)  # fmt: skip
        valid = (n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        m_i, l_i, acc = _softmax_step(
            q, k, v, valid, m_i, l_i, acc, qk_scale, True, DOT_DTYPE, KV_FP8, ASM_CVT
        )

    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    if not SPLIT:
        tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :], out, mask=q_mask)
    else:
        # Partial per (token, head, split), as the decode split kernel writes it; a row that sees no key
        # of this split (empty split, or all its keys in the row's future) has l_i = 0 and lse = -inf.
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        row = rows * n_heads + head  # mid_*: [T, Hq, num_splits, (D)]
        tl.store(mid_lse_ptr + row * num_splits + split, lse, mask=m_mask)
        o_off = (row[:, None] * num_splits + split) * HEAD_DIM + offs_d[None, :]
        tl.store(mid_o_ptr + o_off, out, mask=q_mask)


def dot_dtype(cache_dtype: torch.dtype, device: torch.device) -> tl.dtype:
    """The dtype fed to tl.dot: the cache dtype, except bf16 under the CPU interpreter, whose bf16 dot
    is wrong (numpy has no bf16); there the operands are widened to fp32, which is exact for bf16. The
    attention launchers pass q's dtype for an FP8 cache (`_dots`)."""
    if cache_dtype == torch.float32 or (cache_dtype == torch.bfloat16 and device.type == "cpu"):
        return tl.float32
    return tl.bfloat16 if cache_dtype == torch.bfloat16 else tl.float16


def _dots(q: torch.Tensor, kv_layer: torch.Tensor) -> tuple[tl.dtype, bool, bool]:
    """(DOT_DTYPE, KV_FP8, ASM_CVT) of an attention launch. An FP8 cache computes in fp16 beside a bf16 or
    fp16 q (e4m3 widens to fp16 exactly, and fp16 keeps q and P to 11 bits where bf16 keeps 8), in fp32
    beside an fp32 q; a compiled kernel widens its V tiles by asm (`_widen_v`), the interpreter by a cast."""
    if kv_layer.dtype != torch.float8_e4m3fn:
        return dot_dtype(kv_layer.dtype, q.device), False, False
    return (tl.float32 if q.dtype == torch.float32 else tl.float16), True, q.device.type == "cuda"


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, sm_count: int, kv_fp8: bool = False
) -> int:
    """Splits of each sequence's context for decode, so that the (seq, KV head, split) programs number
    about four per SM: a 16-bit cache's four-warp programs at most four (a count past that leaves a second,
    partly filled round), an FP8 cache's one-warp programs at least four; no split shorter than 256 tokens,
    since each split costs a partial write and a reduction read of [Hq, D] fp32."""
    programs = num_seqs * num_kv_heads
    wanted = -(-4 * sm_count // programs) if kv_fp8 else 4 * sm_count // programs
    by_length = -(-max_seq_len // 256)
    return max(1, min(wanted, by_length, _MAX_SPLITS))


def decode_tile(kv_fp8: bool, num_splits: int) -> tuple[int, int, int]:
    """(keys per tile, num_warps, num_stages) of the decode split kernel: `_DECODE_TILES`'s for the cache
    dtype, except an FP8 cache cut into `_FP8_WIDE_SPLITS` splits or more (a few sequences), which runs the
    16-bit cache's four warps (one warp's one-launch reducer is slow over many splits)."""
    if kv_fp8 and num_splits >= _FP8_WIDE_SPLITS:
        return _FP8_WIDE_TILE
    return _DECODE_TILES[kv_fp8]


def choose_one_launch(group: int, num_splits: int, num_warps: int) -> bool:
    """Whether decode weighs its splits in the split kernel's own launch (the last split of each (seq, KV
    head) to finish) rather than in a second launch. Measured on an H200 (docs/benchmarks.md), one launch
    against two: 0.89x the time at batch 1 x 1.2k (32 splits) down to 1.00x at batch 64 x 4k (2 splits),
    never slower, at four warps; a one-warp program (FP8 at few splits) only while its reducer weighs at
    most `_ONE_WARP_REDUCE_ROWS` rows. One split is one launch either way: it stores the output itself."""
    rows = triton.next_power_of_2(group) * triton.next_power_of_2(num_splits)
    return num_warps >= 4 or rows <= _ONE_WARP_REDUCE_ROWS


def choose_prefill_splits(
    num_heads: int, num_seqs: int, max_query_len: int, max_seq_len: int, sm_count: int, block_m: int = 64
) -> int:
    """Splits of each sequence's keys for prefill: 1 while the (Hq, seq, query tile) programs alone are at
    least the SMs; below that (a short suffix over a long cached prefix), enough to give every SM about
    four programs, but no split shorter than 512 keys, so a context under 1,024 keys never splits."""
    programs = num_heads * num_seqs * -(-max_query_len // block_m)
    if programs >= sm_count:
        return 1
    wanted = -(-4 * sm_count // programs)
    by_length = max_seq_len // _MIN_PREFILL_SPLIT
    return max(1, min(wanted, by_length, _MAX_SPLITS))


_tickets: dict[torch.device, torch.Tensor] = {}


def decode_tickets(device: torch.device) -> torch.Tensor:
    """The one-launch decode's ticket counters on `device`: [_MAX_TICKETS] int32, one per (seq, KV head),
    0 between launches (each reducing program sets its own back). Made once per device, outside any CUDA
    graph capture (every capture here runs its forward eagerly first), so a graph holds their address;
    launches that share them must be ordered, as a device's forwards are (one stream)."""
    if device not in _tickets:
        assert device.type != "cuda" or not torch.cuda.is_current_stream_capturing(), (
            "the decode ticket counters are made on the first launch: run paged_decode_attention once "
            "outside the CUDA graph capture"
        )
        _tickets[device] = torch.zeros(_MAX_TICKETS, dtype=torch.int32, device=device)
    return _tickets[device]


def paged_decode_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    block_n: int | None = None,
    one_launch: bool | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """q: [S, Hq, D] -> [S, Hq, D] in q's dtype; one query token per sequence at position seq_len - 1.

    Grid (S, Hkv, num_splits) for the split kernel; with `one_launch` the last split of each (seq, KV
    head) to finish reduces in the same launch, else the reduction is a second launch over (S, Hq); by
    default `choose_one_launch` decides. block_n (keys per tile, a power of two), num_warps, num_stages: by
    default `decode_tile`'s (benchmarks/attention_sweep.py gives others).
    Inputs are trusted: TritonOps.decode_attention checks them.
    """
    n_seqs, n_heads, head_dim = q.shape
    _, _, block_size, n_kv, _ = kv_layer.shape
    group = n_heads // n_kv
    assert 1 <= num_splits <= _MAX_SPLITS, f"num_splits must be in [1, {_MAX_SPLITS}], got {num_splits}"
    out = torch.empty_like(q)
    if n_seqs == 0:
        return out
    dots, kv_fp8, asm_cvt = _dots(q, kv_layer)
    default_n, default_warps, default_stages = decode_tile(kv_fp8, num_splits)
    warps, stages = num_warps or default_warps, num_stages or default_stages
    if one_launch is None:
        one_launch = choose_one_launch(group, num_splits, warps) and n_seqs * n_kv <= _MAX_TICKETS
    assert not one_launch or n_seqs * n_kv <= _MAX_TICKETS, (
        f"one launch takes at most {_MAX_TICKETS} (seq, KV head) pairs, got {n_seqs} x {n_kv}"
    )
    if one_launch and num_splits == 1:
        mid_o = mid_lse = tickets = out  # not touched: the one split stores the output itself
    else:
        mid_o = torch.empty((n_seqs, n_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((n_seqs, n_heads, num_splits), dtype=torch.float32, device=q.device)
        tickets = decode_tickets(q.device) if one_launch else seq_lens  # seq_lens: not read
    k_cache, v_cache = kv_layer[0], kv_layer[1]
    dim_pad = triton.next_power_of_2(head_dim)
    group_r, splits_pad = triton.next_power_of_2(group), triton.next_power_of_2(num_splits)
    # the reducing program's chunk: about _REDUCE_VALUES_PER_THREAD fp32 partial values a thread
    fit = _REDUCE_VALUES_PER_THREAD * 32 * warps // (group_r * dim_pad)
    r_chunk = min(splits_pad, 1 << max(0, fit.bit_length() - 1))
    _decode_split_kernel[(n_seqs, n_kv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, mid_o, mid_lse, out, tickets, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n or default_n, NUM_SPLITS=num_splits, DOT_DTYPE=dots,
        KV_FP8=kv_fp8, ASM_CVT=asm_cvt, ONE_LAUNCH=one_launch, GROUP_R=group_r, SPLITS_PAD=splits_pad,
        R_CHUNK=r_chunk, num_warps=warps, num_stages=stages, **pdl_launch(q.device),
    )  # fmt: skip
    if not one_launch:
        _reduce_splits(mid_o, mid_lse, out)
    return out


def _reduce_splits(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor) -> None:
    """mid_o: [R, Hq, splits, D] fp32, mid_lse: [R, Hq, splits] fp32 -> out: [R, Hq, D] (any float dtype,
    head dim contiguous); R = sequences for decode, query tokens for prefill."""
    n_rows, n_heads, num_splits, head_dim = mid_o.shape
    assert mid_lse.shape == (n_rows, n_heads, num_splits) and out.shape == (n_rows, n_heads, head_dim), (
        f"mid_o {tuple(mid_o.shape)}, mid_lse {tuple(mid_lse.shape)} and out {tuple(out.shape)} disagree"
    )
    assert mid_o.is_contiguous() and mid_lse.is_contiguous() and out.stride(2) == 1
    _reduce_splits_kernel[(n_rows, n_heads)](
        mid_o, mid_lse, out, out.stride(0), out.stride(1), num_splits,
        HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim),
        SPLITS_CHUNK=min(_SPLITS_CHUNK, triton.next_power_of_2(num_splits)), num_warps=4,
        **pdl_launch(out.device),
    )  # fmt: skip


def paged_prefill_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    num_splits: int = 1,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D] in q's dtype; causal over each sequence's cached prefix and new tokens.

    kv_layer: [2, N, block_size, Hkv, D]; block_tables: [S, max_blocks] int32; seq_lens: [S] int32 (cached
    + new); query_start_loc: [S + 1] int32 offsets into T. Grid (num_splits * Hq, S,
    ceil(max_query_len / block_m)); tiles past a sequence's query length exit at once. With num_splits > 1
    each tile's visible keys are split and the partials reduced (choose_prefill_splits picks the count).
    Inputs are trusted: TritonOps.prefill_attention checks them.
    """
    n_tokens, n_heads, head_dim = q.shape
    _, _, block_size, n_kv, _ = kv_layer.shape
    n_seqs = seq_lens.shape[0]
    assert 1 <= num_splits <= _MAX_SPLITS, f"num_splits must be in [1, {_MAX_SPLITS}], got {num_splits}"
    assert query_start_loc.shape == (n_seqs + 1,) and block_tables.shape[0] == n_seqs, (
        f"query_start_loc {tuple(query_start_loc.shape)} and block_tables {tuple(block_tables.shape)} must "
        f"be [S+1] and [S, max_blocks] for S = {n_seqs}"
    )
    out = torch.empty_like(q)
    if n_tokens == 0 or n_seqs == 0:
        return out
    k_cache, v_cache = kv_layer[0], kv_layer[1]
    if num_splits == 1:
        mid_o = mid_lse = out  # not read: the single pass writes out directly
    else:
        mid_o = torch.empty((n_tokens, n_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((n_tokens, n_heads, num_splits), dtype=torch.float32, device=q.device)
    grid = (num_splits * n_heads, n_seqs, math.ceil(max_query_len / block_m))
    dots, kv_fp8, asm_cvt = _dots(q, kv_layer)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, mid_o, mid_lse, block_tables, seq_lens, query_start_loc, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), num_splits,
        GROUP=n_heads // n_kv, HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=num_splits > 1,
        DOT_DTYPE=dots, KV_FP8=kv_fp8, ASM_CVT=asm_cvt, num_warps=4, num_stages=2,
    )  # fmt: skip
    if num_splits > 1:
        _reduce_splits(mid_o, mid_lse, out)
    return out
