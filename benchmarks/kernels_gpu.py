"""Triton attention kernels on a CUDA GPU: correctness against the torch reference, then speed.

Prints one table. Decode attention is timed at batch 64 x 4k context in the Llama-3.1-8B shape
(32 query heads, 8 KV heads, head dim 128, bf16, block 16) and its achieved bandwidth (KV bytes read /
median time) is printed next to the device-to-device copy bandwidth measured in the same run (bytes read
+ written). Prefill attention is timed on one 4096-token sequence, next to torch SDPA on contiguous K/V,
and on a 16-token suffix over a 16,384-token cached prefix (a fetched prefix's step), split-K as
TritonOps chooses it next to the single pass (num_splits=1) it replaces, per layer and x 32 layers.

    python -m pdserve.benchmarks.kernels_gpu
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton.testing
from pdserve.kernels.ops import AttentionMetadata, RopeTables
from pdserve.kernels.reference import ReferenceOps
from pdserve.kernels.triton_attention import (
    choose_num_splits,
    choose_prefill_splits,
    paged_prefill_attention,
)
from pdserve.kernels.triton_ops import TritonOps
from pdserve.shared.model.model import rope_inv_freq

GIB = 1024**3
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def paged_batch(
    specs: list[tuple[int, int]],
    n_heads: int,
    n_kv: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """specs: (cached prefix, new tokens) per sequence -> q [T, Hq, D], kv [2, N, B, Hkv, D] with random
    K/V in every context slot, and metadata whose block tables are a random permutation of the blocks."""
    lens = [ctx + new for ctx, new in specs]
    per_seq = [-(-n // block_size) for n in lens]
    n_blocks = sum(per_seq)
    kv = torch.randn(2, n_blocks, block_size, n_kv, head_dim, device=device).to(dtype)
    perm = torch.randperm(n_blocks, device=device).to(torch.int32)
    tables = torch.zeros(len(specs), max(per_seq), dtype=torch.int32, device=device)
    start = 0
    for s, nb in enumerate(per_seq):
        tables[s, :nb] = perm[start : start + nb]
        start += nb
    q_starts = [0]
    for _, new in specs:
        q_starts.append(q_starts[-1] + new)
    q = torch.randn(q_starts[-1], n_heads, head_dim, device=device).to(dtype)
    meta = AttentionMetadata(
        positions=torch.cat([torch.arange(ctx, ctx + new, device=device) for ctx, new in specs]),
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(q_starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=tables,
        max_query_len=max(new for _, new in specs),
        max_seq_len=max(lens),
        rope=RopeTables.from_inv_freq(rope_inv_freq(head_dim, 10000.0, None), max(lens), device),
    )
    return q, kv, meta


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| relative to max(1, |want|), elementwise."""
    diff = (got.float() - want.float()).abs() / want.float().abs().clamp(min=1.0)
    return float(diff.max()) if diff.numel() else 0.0


def check_all(device: torch.device) -> list[tuple[str, str, float, float]]:
    """(op, case, max relative error, tolerance) for every kernel on random data."""
    ref, tri = ReferenceOps(), TritonOps()
    rows = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        tol = TOLERANCE[dtype]
        name = str(dtype).removeprefix("torch.")
        for n_heads, n_kv, head_dim in ((32, 8, 128), (9, 3, 64), (8, 8, 64)):
            shape = f"{name} Hq={n_heads} Hkv={n_kv} D={head_dim}"
            specs = [(0, 1), (15, 1), (16, 1), (1000, 1), (4095, 1)]
            q, kv, meta = paged_batch(specs, n_heads, n_kv, head_dim, 16, dtype, device)
            scale = head_dim**-0.5
            want = ref.decode_attention(q, kv, meta, scale)
            rows.append(("decode", shape, max_error(tri.decode_attention(q, kv, meta, scale), want), tol))
            specs = [(0, 300), (0, 1), (37, 200), (512, 64), (16, 17)]
            q, kv, meta = paged_batch(specs, n_heads, n_kv, head_dim, 16, dtype, device)
            want = ref.prefill_attention(q, kv, meta, scale)
            rows.append(("prefill", shape, max_error(tri.prefill_attention(q, kv, meta, scale), want), tol))
        rows += check_copies(ref, tri, dtype, device)
    return rows


def check_copies(
    ref: ReferenceOps, tri: TritonOps, dtype: torch.dtype, device: torch.device
) -> list[tuple[str, str, float, float]]:
    """gather_blocks and scatter_blocks must match the reference bit for bit."""
    name = str(dtype).removeprefix("torch.")
    kv = torch.randn(2, 64, 16, 8, 128, device=device).to(dtype)
    kv_ref, kv_tri = kv.clone(), kv.clone()
    rows: list[tuple[str, str, float, float]] = []
    ids = torch.randperm(64, device=device)[:20]
    out_ref = torch.empty(2, 20, 16, 8, 128, dtype=dtype, device=device)
    out_tri = torch.empty_like(out_ref)
    ref.gather_blocks(kv, ids, out_ref)
    tri.gather_blocks(kv, ids, out_tri)
    rows.append(("gather_blocks", f"{name} n=20", max_error(out_tri, out_ref), 0.0))
    ref.scatter_blocks(out_ref.flip(1), kv_ref, ids)
    tri.scatter_blocks(out_ref.flip(1), kv_tri, ids)
    rows.append(("scatter_blocks", f"{name} n=20", max_error(kv_tri, kv_ref), 0.0))
    return rows


def median_ms(fn: Callable[[], object]) -> float:
    return float(triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median"))


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy of 1 GiB, in GiB/s counting bytes read plus bytes written."""
    src = torch.empty(GIB, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / GIB / (median_ms(lambda: dst.copy_(src)) / 1e3)


def time_decode(device: torch.device) -> list[tuple[str, str, str]]:
    batch, ctx, n_heads, n_kv, head_dim, block_size = 64, 4096, 32, 8, 128, 16
    q, kv, meta = paged_batch(
        [(ctx - 1, 1)] * batch, n_heads, n_kv, head_dim, block_size, torch.bfloat16, device
    )
    tri, ref = TritonOps(), ReferenceOps()
    scale = head_dim**-0.5
    kv_bytes = 2 * batch * ctx * n_kv * head_dim * kv.element_size()
    sm = torch.cuda.get_device_properties(device).multi_processor_count
    splits = choose_num_splits(batch, n_kv, ctx, sm)
    copy = copy_bandwidth(device)
    triton_ms = median_ms(lambda: tri.decode_attention(q, kv, meta, scale))
    ref_ms = median_ms(lambda: ref.decode_attention(q, kv, meta, scale))
    bw = kv_bytes / GIB / (triton_ms / 1e3)
    shape = f"B={batch} ctx={ctx} Hq={n_heads} Hkv={n_kv} D={head_dim} bf16 blk={block_size}"
    return [
        (
            "decode triton",
            shape,
            f"{triton_ms * 1e3:.1f} us, {bw:.0f} GiB/s ({100 * bw / copy:.0f}% of copy)",
        ),
        ("decode splits", f"{sm} SMs", f"{splits}"),
        ("decode torch reference", shape, f"{ref_ms * 1e3:.1f} us"),
        ("device copy (read+write)", "1 GiB uint8", f"{copy:.0f} GiB/s"),
    ]


def time_prefill(device: torch.device) -> list[tuple[str, str, str]]:
    tokens, n_heads, n_kv, head_dim = 4096, 32, 8, 128
    q, kv, meta = paged_batch([(0, tokens)], n_heads, n_kv, head_dim, 16, torch.bfloat16, device)
    tri = TritonOps()
    scale = head_dim**-0.5
    n_blocks = meta.block_tables.shape[1]
    blocks = meta.block_tables[0, :n_blocks].long()
    # Contiguous [1, H, T, D] copies for SDPA, the peer that does not pay for paging.
    k = kv[0, blocks].flatten(0, 1)[:tokens].transpose(0, 1)[None]
    v = kv[1, blocks].flatten(0, 1)[:tokens].transpose(0, 1)[None]
    qs = q.transpose(0, 1)[None]
    flops = 4 * n_heads * head_dim * tokens * (tokens + 1) / 2  # causal: QK^T and PV over the lower triangle
    triton_ms = median_ms(lambda: tri.prefill_attention(q, kv, meta, scale))
    sdpa_ms = median_ms(lambda: F.scaled_dot_product_attention(qs, k, v, is_causal=True, enable_gqa=True))
    shape = f"T={tokens} Hq={n_heads} Hkv={n_kv} D={head_dim} bf16"
    return [
        ("prefill triton (paged)", shape, f"{triton_ms:.3f} ms, {flops / triton_ms / 1e9:.0f} TFLOP/s"),
        ("prefill torch SDPA (contiguous)", shape, f"{sdpa_ms:.3f} ms, {flops / sdpa_ms / 1e9:.0f} TFLOP/s"),
    ]


def time_prefill_suffix(device: torch.device) -> list[tuple[str, str, str]]:
    ctx, new, n_heads, n_kv, head_dim, layers = 16384, 16, 32, 8, 128, 32
    q, kv, meta = paged_batch([(ctx, new)], n_heads, n_kv, head_dim, 16, torch.bfloat16, device)
    tri = TritonOps()
    scale = head_dim**-0.5
    sm = torch.cuda.get_device_properties(device).multi_processor_count
    splits = choose_prefill_splits(n_heads, 1, new, ctx + new, sm)
    args = (q, kv, meta.block_tables, meta.seq_lens, meta.query_start_loc, new, scale)
    single_ms = median_ms(lambda: paged_prefill_attention(*args, 1))
    split_ms = median_ms(lambda: tri.prefill_attention(q, kv, meta, scale))
    shape = f"ctx={ctx} new={new} Hq={n_heads} Hkv={n_kv} D={head_dim} bf16"
    return [
        (
            "prefill suffix, 1 pass (before)",
            shape,
            f"{single_ms * 1e3:.1f} us, x{layers} {single_ms * layers:.2f} ms",
        ),
        (
            f"prefill suffix, {splits} splits",
            shape,
            f"{split_ms * 1e3:.1f} us, x{layers} {split_ms * layers:.2f} ms",
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", default="cuda:0", help="CUDA device to run on (default cuda:0)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        available = torch.cuda.is_available()
        print(f"kernels_gpu: needs a CUDA device, got {args.device!r} (CUDA available: {available})")
        return 2
    torch.manual_seed(0)
    name = torch.cuda.get_device_name(device)
    print(f"device: {name}, torch {torch.__version__}, triton {triton.__version__}")
    checks = check_all(device)
    width = max(len(c[1]) for c in checks)
    print(f"\n{'op':<16}{'case':<{width + 2}}{'max rel err':>12}  {'tol':>8}  ok")
    for op, case, err, tol in checks:
        print(f"{op:<16}{case:<{width + 2}}{err:>12.2e}  {tol:>8.0e}  {'yes' if err <= tol else 'NO'}")
    timings = time_decode(device) + time_prefill(device) + time_prefill_suffix(device)
    width = max(len(t[1]) for t in timings)
    print(f"\n{'what':<34}{'shape':<{width + 2}}result")
    for what, shape, result in timings:
        print(f"{what:<34}{shape:<{width + 2}}{result}")
    failed = [c for c in checks if c[2] > c[3] or math.isnan(c[2])]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
