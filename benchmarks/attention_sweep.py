"""Decode attention's split count and tile per shape on this GPU: the launcher's own choice (TritonOps, as a
CUDA graph captured at max_model_len 8,192 runs it) beside every candidate, at the head counts of one rank
of Llama-3.1-8B at TP=1 (32 query heads over 8 KV heads) and TP=2 (16 over 4). Prints one markdown table per
(heads, batch, context); `--out` gets the JSON.

    python benchmarks/attention_sweep.py --tp 1,2

Shapes: batch 1 at 1,168 keys (tp_decode.py's batch-1 context), batch 8, 16, 32, 64 and 128 at 2,048, head
dim 128, bf16 cache in blocks of 16 in a random block order. Candidates: split counts by batch, tiles (keys
per tile, warps, stages), all one launch (`choose_one_launch` says so for every 16-bit cache). Each is
checked against the launcher's choice (max abs difference <= 2^-7 of the largest output) and timed as a
CUDA graph of back-to-back launches rotating over as many layer caches as exceed the L2 cache several
times, so each launch reads its keys from HBM as decode does. KV bytes over the median time, against the
copy bandwidth of the same run (bytes read + written).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
from functools import partial
from typing import Any

import torch
from pdserve.benchmarks.gpu_decode import GIB, copy_bandwidth, decode_meta, graph_us, log, release
from pdserve.kernels.triton_attention import choose_num_splits, decode_tile, paged_decode_attention
from pdserve.kernels.triton_ops import TritonOps
from pdserve.shared.model.model_config import NAMED_SHAPES

SHAPE = "llama-3.1-8b"
GRAPH_MAX_SEQ_LEN = 8192  # the decode graphs' max_seq_len (tp_decode.py's max_model_len)
# (batch, context, split counts tried, tiles tried)
FEW = ((64, 4, 3), (32, 4, 3), (16, 4, 3))
MANY = ((64, 4, 3), (32, 4, 3), (128, 8, 2))
CASES: tuple[tuple[int, int, tuple[int, ...], tuple[tuple[int, int, int], ...]], ...] = (
    (1, 1168, (16, 32, 64), FEW),
    (8, 2048, (4, 8, 16, 32), MANY[:1]),
    (16, 2048, (2, 4, 6, 8, 16), MANY[:1]),
    (32, 2048, (2, 3, 4, 6, 8), MANY[:1]),
    (64, 2048, (1, 2, 3, 4, 6, 8), MANY),
    (128, 2048, (1, 2, 3, 4), MANY),
)
TOL = 2.0**-7


def sweep_case(
    tp: int, batch: int, ctx: int, splits: tuple[int, ...], tiles: tuple[tuple[int, int, int], ...],
    dev: torch.device, l2_bytes: int,
) -> dict[str, Any]:  # fmt: skip
    c = NAMED_SHAPES[SHAPE]
    hq, hkv, d, block = c.num_heads // tp, c.num_kv_heads // tp, c.head_dim, 16
    meta = decode_meta(c, dev, batch, ctx, block)
    per_layer = 2 * batch * ctx * hkv * d * 2
    layers = max(1, min(32, math.ceil(4 * l2_bytes / per_layer)))
    kvs = [torch.randn(2, batch * ctx // block, block, hkv, d, device=dev).to(torch.bfloat16)]
    kvs += [kvs[0].clone() for _ in range(layers - 1)]
    q = torch.randn(batch, hq, d, device=dev, dtype=torch.bfloat16)
    scale = d**-0.5
    # as a graph holds them: tables max_model_len wide (the columns past a context never read)
    tables = torch.nn.functional.pad(meta.block_tables, (0, GRAPH_MAX_SEQ_LEN // block - ctx // block))
    graph_meta = dataclasses.replace(meta, block_tables=tables, max_seq_len=GRAPH_MAX_SEQ_LEN)
    ops = TritonOps()
    want = ops.decode_attention(q, kvs[0], graph_meta, scale).float()
    ref_max = want.abs().max().item()
    rows: list[dict[str, Any]] = []
    current = graph_us([partial(ops.decode_attention, q, kv, graph_meta, scale) for kv in kvs])
    for n_splits, (bn, warps, stages) in itertools.product(splits, tiles):
        entry: dict[str, Any] = {"splits": n_splits, "tile": [bn, warps, stages]}
        rows.append(entry)
        run = partial(paged_decode_attention, block_tables=tables, seq_lens=meta.seq_lens,
                      scale=scale, num_splits=n_splits, block_n=bn, num_warps=warps,
                      num_stages=stages)  # fmt: skip
        try:
            err = (run(q, kvs[0]).float() - want).abs().max().item() / ref_max
            if not err <= TOL:
                raise ValueError(f"max error {err:.2e} of the largest output > {TOL:.1e}")
            entry["us"] = graph_us([partial(run, q, kv) for kv in kvs])
        except Exception as exc:  # a config that fails is reported and the sweep goes on
            entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
            log(f"TP={tp} batch {batch}: {entry}")
    del kvs
    release(dev)
    sm = torch.cuda.get_device_properties(dev).multi_processor_count
    chosen = choose_num_splits(batch, hkv, GRAPH_MAX_SEQ_LEN, sm)
    return {"tp": tp, "hq": hq, "hkv": hkv, "batch": batch, "ctx": ctx, "kv_bytes": per_layer,
            "current": [chosen, list(decode_tile(False, chosen))], "current_us": current,
            "tried": rows}  # fmt: skip


def markdown(case: dict[str, Any], copy_bw: float) -> str:
    kv, (chosen, tile), now = case["kv_bytes"], case["current"], case["current_us"]
    head = f"### TP={case['tp']} (Hq {case['hq']}, Hkv {case['hkv']}), batch {case['batch']} x {case['ctx']}"
    pct = kv / (now / 1e6) / copy_bw
    lines = [f"{head} keys: current {chosen} splits, {tuple(tile)}: {now:.1f} us ({pct:.0%} of copy)", "",
             "| splits | tile (keys, warps, stages) | us | % of copy |", "|---|---|---|---|"]  # fmt: skip
    for t in sorted(case["tried"], key=lambda t: t.get("us", math.inf)):
        us = t.get("us")
        cells = ("failed", t["error"]) if us is None else (f"{us:.1f}", f"{kv / (us / 1e6) / copy_bw:.0%}")
        lines.append(f"| {t['splits']} | {tuple(t['tile'])} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Sweep decode attention's splits and tiles per shape.")
    parser.add_argument("--tp", default="1,2", help="comma-separated TP sizes (heads per rank: 32/tp, 8/tp)")
    parser.add_argument("--batches", default=",".join(str(b) for b, *_ in CASES),
                        help="comma-separated batch sizes among the cases")  # fmt: skip
    parser.add_argument("--out", default="attention_sweep.json")
    parser.add_argument("--device", default="cuda:0")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.tp.split(",")]
    batches = {int(b) for b in args.batches.split(",")}
    if not torch.cuda.is_available():
        print("attention_sweep: needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    copy_bw = copy_bandwidth(dev)
    release(dev)
    l2 = int(getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 50 << 20))
    log(f"{torch.cuda.get_device_name(dev)}: copy {copy_bw / GIB:.0f} GiB/s")
    cases = []
    for batch, ctx, splits, tiles in CASES:
        if batch not in batches:
            continue
        for tp in sizes:
            cases.append(sweep_case(tp, batch, ctx, splits, tiles, dev, l2))
            log(f"TP={tp} batch {batch}: current {cases[-1]['current_us']:.1f} us")
            print(markdown(cases[-1], copy_bw), "\n", flush=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"device": torch.cuda.get_device_name(dev), "copy_bytes_per_s": copy_bw, "cases": cases}, f,
                  indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
