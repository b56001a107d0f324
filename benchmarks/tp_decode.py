"""Decode at tensor-parallel size 1 and 2 through the engine loop on one host's GPUs, against the HBM
roofline of the bytes each rank reads per step (the all-reduce alone: benchmarks/tp_allreduce.py).
Prints one markdown table; `--out` gets the JSON.

    python benchmarks/tp_decode.py --shape llama-3.1-8b --tp 1,2
    python benchmarks/tp_decode.py --shape llama-3.1-70b --tp 2

Each engine loads its own seeded dummy weights (rank r draws its shard of the same model); async scheduling
as `--async-scheduling` says, at every size. Batch-1 decode runs at ~1.2k context, throughput at batch 64
and 2k context. The roofline of TP=N: the copy bandwidth of one GPU over the bytes one rank reads per step
(its weight shard, the embedding table excepted, plus its KV heads' share), since the N GPUs read in
parallel. Every request is greedy, so at TP > 1 every step should end in the greedy tokens' all-gather
(no logits gathered on rank 0: docs/engine.md); a row says how many steps did. Batch 128 at 2k context has
its roofline too, and one 4,096-token prefill step is reported as MFU: the step's matmul and causal
attention FLOPs over its time and the device's dense bf16 peak (`--peak-tflops`, else known per device).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Iterable

import torch
from pdserve.benchmarks.gpu_decode import (
    copy_bandwidth,
    engine_decode,
    engine_step_seconds,
    kv_bytes_per_token,
    log,
    markdown,
    random_tokens,
    release,
)
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import LLMEngine
from pdserve.shared.engine.sampling_params import SamplingParams
from pdserve.shared.model.model_config import NAMED_SHAPES
from pdserve.shared.types import RequestId

Row = tuple[str, str, str, str]

DENSE_BF16_PEAK = {"H100": 989.4e12, "H200": 989.4e12, "B200": 2250e12}
"""Dense (no sparsity) bf16 tensor-core FLOP/s by device name (NVIDIA's data sheets; H100 and H200 SXM)."""


def prefill_flops(shape: str, tokens: int) -> float:
    """FLOPs of one prefill of `tokens` tokens: 2 per weight per token for the layers' products (a sparse
    layer's top-k experts, shared expert and router), causal attention's QK^T and PV (T^2 / 2 pairs each,
    2 FLOPs per element), and the LM head for the one sampled position."""
    c = NAMED_SHAPES[shape]
    h, d = c.hidden_size, c.head_dim
    q, kv = c.num_heads * d, c.num_kv_heads * d
    weights = 0
    for layer in range(c.num_layers):
        weights += h * (q + 2 * kv) + q * h
        moe = c.moe
        if moe is None or layer in moe.mlp_only_layers or (layer + 1) % moe.decoder_sparse_step:
            weights += 3 * h * c.intermediate_size
        else:
            weights += moe.top_k * 3 * h * moe.intermediate_size + moe.num_experts * h
            weights += 3 * h * moe.shared_expert_intermediate_size
    attention = c.num_layers * 2 * 2 * (tokens * tokens / 2) * q
    return 2.0 * weights * tokens + attention + 2.0 * c.vocab_size * h


def _weight_bytes(shape: str, tp: int, batch: int = 1) -> int:
    """Bytes one rank's weights take per step at TP=tp: every sharded matrix / tp, norms whole, the
    embedding table not read (its LM-head twin is, when tied), bf16. A sparse layer reads its router and
    the experts the step's `batch` tokens select: with top-k of E experts chosen evenly,
    E (1 - (1 - k/E)^batch) distinct experts on average (k at batch 1), plus the shared expert."""
    c = NAMED_SHAPES[shape]
    h, i, d = c.hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_heads * d, max(1, c.num_kv_heads // tp) * d * tp
    attention = h * (q + 2 * kv) // tp + q * h // tp + 2 * h
    total = 0
    for layer in range(c.num_layers):
        moe = c.moe
        if moe is None or layer in moe.mlp_only_layers or (layer + 1) % moe.decoder_sparse_step:
            total += attention + 3 * h * i // tp
            continue
        e, k = moe.num_experts, moe.top_k
        experts = e * (1 - (1 - k / e) ** batch)
        mlp = experts * 3 * h * moe.intermediate_size / tp + e * h
        if moe.shared_expert_intermediate_size:
            mlp += 3 * h * moe.shared_expert_intermediate_size / tp + h
        total += attention + int(mlp)
    lm_head = c.vocab_size * h // tp
    return 2 * (total + lm_head + h)


def busy_us(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals, in their unit: the time at least one kernel runs.
    Not their sum: under programmatic dependent launch (kernels/pdl.py) a kernel starts while its
    predecessor runs and waits at griddepcontrol.wait, so kernels overlap."""
    total, reached = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reached:
            total += end - max(start, reached)
            reached = end
    return total


def profile_rows(engine: LLMEngine, prompts: list[list[int]], steps: int = 48) -> list[Row]:
    """Rank 0's kernels over `steps` decode steps of the batch `prompts` (once every prompt has its first
    token, after two warm steps): the wall time and the GPU busy time (the union of the device events'
    intervals) per step, then one row per kernel name, launches and summed GPU µs per step, heaviest first."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(engine.new_request(RequestId(f"profile-{i}"), p, params))
    started: set[str] = set()
    while len(started) < len(prompts):
        started |= {o.request_id for o in engine.step()}
    for _ in range(2):
        engine.step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    while engine.has_unfinished():
        engine.step()
    device = [e.time_range for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy = busy_us((r.start, r.end) for r in device) / steps
    kernels = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in kernels) / steps
    rows: list[Row] = [
        (f"rank 0, batch-{len(prompts)} step: wall / GPU busy (some kernel running)",
         f"{wall / steps * 1e6:.0f} us", f"{busy:.0f} us", f"kernels' sum {total:.0f} us"),
        ("  kernel (under PDL its time includes its wait for the previous one)", "launches", "GPU us / step",
         "of busy"),
    ]  # fmt: skip
    for e in kernels[:20]:
        us = e.self_device_time_total / steps
        rows.append((f"  {e.key[:90]}", f"{e.count / steps:.1f} / step", f"{us:.1f} us", f"{us / busy:.1%}"))
    return rows


def decode_rows(
    shape: str,
    tp: int,
    overlap: bool,
    bw: float,
    res: dict[str, object],
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
    peak: float | None = None,
    profile: bool = False,
) -> list[Row]:
    c = NAMED_SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    cfg = EngineConfig(model=f"dummy:{shape}", device="cuda", dtype="bfloat16", max_num_seqs=128,
                       max_num_batched_tokens=8192, max_model_len=8192, tensor_parallel_size=tp,
                       async_scheduling=overlap, gpu_memory_utilization=0.90,
                       quantization=quantization, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    log(f"{shape} TP={tp} async={'on' if overlap else 'off'}: loading")
    engine = LLMEngine(cfg)
    try:
        prompt = random_tokens(1024, c.vocab_size, gen)
        skip, n_out = 8, 257
        ctx = 1024 + (skip + n_out) / 2
        kv_dtype = torch.float8_e4m3fn if kv_cache_dtype == "fp8" else torch.bfloat16
        pool_tokens = engine.num_blocks * cfg.block_size
        kv = kv_bytes_per_token(c, kv_dtype) * ctx / min(tp, c.num_kv_heads)
        roof = bw / (_weight_bytes(shape, tp) + kv)
        log("loaded; batch-1 decode")
        b1 = [engine_decode(engine, [prompt], n_out, skip)[0] for _ in range(3)]
        profiled = profile_rows(engine, [prompt]) if profile else []
        log(f"batch 1: {b1}; batch 64")
        prompts = [random_tokens(2048, c.vocab_size, gen) for _ in range(64)]
        b64 = engine_decode(engine, prompts, 16 + 40, 4)[0]
        if profile:
            profiled += profile_rows(engine, prompts, 16)
        kv64 = kv_bytes_per_token(c, kv_dtype) * (2048 + 30) * 64 / min(tp, c.num_kv_heads)
        roof64 = 64 * bw / (_weight_bytes(shape, tp, 64) + kv64)
        prompts = [random_tokens(2048, c.vocab_size, gen) for _ in range(128)]
        b128 = engine_decode(engine, prompts, 32 + 40, 4)[0]
        roof128 = 128 * bw / (_weight_bytes(shape, tp, 128) + 2 * kv64)
        log(f"batch 64 {b64:.0f}, batch 128 {b128:.0f} tok/s; prefill 4096")
        prefill = [engine_step_seconds(engine, random_tokens(4096, c.vocab_size, gen)) for _ in range(4)]
        prefill_s = statistics.median(prefill[1:])
        steps = dict(engine.runner.outputs)  # greedy: at TP > 1 every step should end in "tokens"
    finally:
        engine.close()
        release(torch.device("cuda:0"))
    rate = statistics.median(b1)
    kv_name = "" if kv_cache_dtype == "auto" else f"/kv-{kv_cache_dtype}"
    key = f"{shape}/tp{tp}/async-{'on' if overlap else 'off'}/{quantization or 'bf16'}{kv_name}"
    flops = prefill_flops(shape, 4096)
    mfu = flops / prefill_s / (peak * tp) if peak else None
    res[key] = {"b1": b1, "b64": b64, "roof_b1": roof, "roof_b64": roof64, "b128": b128, "roof_b128": roof128,
                "prefill_4096_s": prefill, "prefill_flops": flops, "peak_flops": peak, "mfu": mfu,
                "pool_tokens": pool_tokens, "steps": steps}  # fmt: skip
    what = f"{shape} {quantization or 'bf16'}{kv_name} TP={tp} async {'on' if overlap else 'off'}"
    return [
        (f"{what}: KV pool (gpu_memory_utilization 0.90)", f"{pool_tokens} tokens", "", ""),
        (f"{what}: batch-1 decode tok/s at ~{ctx:.0f} ctx (median of 3)", f"{rate:.1f}",
         f"roofline {roof:.1f}", f"{rate / roof:.1%}"),
        (f"{what}: batch 64 at 2k ctx, tok/s", f"{b64:.0f}", f"roofline {roof64:.0f}",
         f"{b64 / roof64:.1%}"),
        (f"{what}: batch 128 at 2k ctx, tok/s", f"{b128:.0f}", f"roofline {roof128:.0f}",
         f"{b128 / roof128:.1%}"),
        (f"{what}: prefill 4,096 tokens, one step (median of 3)", f"{prefill_s * 1e3:.1f} ms",
         f"{flops / 1e12:.1f} TFLOP, peak {peak * tp / 1e12:.0f} TFLOP/s" if peak else "peak unknown",
         f"MFU {mfu:.1%}" if mfu else ""),
        (f"{what}: steps ending in greedy tokens / in gathered logits", f"{steps.get('tokens', 0)}",
         f"{steps.get('logits', 0)}", "TP > 1: no logits gather" if tp > 1 else "TP = 1: own logits"),
        *profiled,
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(NAMED_SHAPES))
    parser.add_argument("--tp", default="1,2", help="comma-separated TP sizes")
    parser.add_argument("--async-scheduling", choices=["on", "off"], default="on")
    parser.add_argument(
        "--fp8-beside",
        action="store_true",
        help="also each size with FP8 weights (--quantization fp8); its roofline stays bf16's",
    )
    parser.add_argument(
        "--kv-fp8-beside",
        action="store_true",
        help="also each size with an FP8 KV cache (--kv-cache-dtype fp8), bf16 weights; roofline with FP8 KV",
    )
    parser.add_argument("--quantization", choices=["none", "fp8"], default="none",
                        help="the weights of every size's main run")  # fmt: skip
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="the KV cache of every size's main run")  # fmt: skip
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="dense bf16 peak for the prefill's MFU (default: known per device)")  # fmt: skip
    parser.add_argument("--profile", action="store_true",
                        help="also rank 0's kernels per step at batch 1 and 64 (torch.profiler)")  # fmt: skip
    parser.add_argument("--out", default="tp_decode.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("tp_decode: needs CUDA GPUs", file=sys.stderr)
        return 2
    sizes = [int(s) for s in args.tp.split(",")]
    if max(sizes) > torch.cuda.device_count():
        print(f"tp_decode: TP={max(sizes)} needs {max(sizes)} GPUs, {torch.cuda.device_count()} visible",
              file=sys.stderr)  # fmt: skip
        return 2
    bw = copy_bandwidth(torch.device("cuda:0"))
    name = torch.cuda.get_device_name(0)
    known = [flops for key, flops in DENSE_BF16_PEAK.items() if key in name]
    peak = args.peak_tflops * 1e12 if args.peak_tflops else (known[0] if known else None)
    res: dict[str, object] = {"copy_bytes_per_s": bw, "gpu": name}
    rows: list[Row] = [("copy bandwidth, cuda:0", f"{bw / (1 << 30):.0f} GiB/s", "", "")]
    overlap = args.async_scheduling == "on"
    for tp in sizes:
        quant = None if args.quantization == "none" else args.quantization
        rows += decode_rows(args.shape, tp, overlap, bw, res, quant, args.kv_cache_dtype, peak, args.profile)
        if args.fp8_beside:
            rows += decode_rows(args.shape, tp, overlap, bw, res, "fp8", peak=peak)
        if args.kv_fp8_beside:
            rows += decode_rows(args.shape, tp, overlap, bw, res, None, "fp8", peak)
    got = {
        int(k.split("/tp")[1].split("/")[0]): v for k, v in res.items() if "/tp" in k and k.endswith("bf16")
    }
    if 1 in got and 2 in got:
        b1 = statistics.median(got[2]["b1"]) / statistics.median(got[1]["b1"])  # type: ignore[index]
        b64 = got[2]["b64"] / got[1]["b64"]  # type: ignore[index]
        mode = args.async_scheduling
        rows.append((f"{args.shape} TP=2 / TP=1 (async scheduling {mode})",
                     f"batch 1 {b1:.2f}x, batch 64 {b64:.2f}x", "targets 1.6x / 1.7x", ""))  # fmt: skip
    print(markdown(rows))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
