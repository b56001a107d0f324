"""Where a batch-1 decode step's GPU time goes, for each matrix-product backend (a diagnostic).

    python benchmarks/decode_breakdown.py --shape llama-3.1-8b --ctx 1024

For cuBLAS (`DenseLinear`) and the Triton GEMV (`GemvLinear`), on the same seeded dummy weights: the
ModelRunner step under CUDA graphs and eager, and the eager step's GPU kernel time by kernel kind under
the torch profiler, beside the roofline (weight + KV bytes read per step over the copy bandwidth).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import time

import torch
from pdserve.benchmarks.gpu_decode import copy_bandwidth, kv_bytes_per_token, weight_bytes_read
from pdserve.kernels.linear import DenseLinear, GemvLinear, Linear
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.model_runner import BatchItem, ModelRunner
from pdserve.shared.model.loader import LoadedModel, load_model
from torch.profiler import ProfilerActivity, profile

GIB = 1 << 30
KINDS = ("gemv", "nvjet", "gemm", "splitk", "decode", "rms", "rope", "silu", "argmax", "index", "copy")


def kind(name: str) -> str:
    low = name.lower()
    return next((k for k in KINDS if k in low), name[:40])


def step_ms(runner: ModelRunner, step: list[BatchItem], n: int) -> float:
    for _ in range(5):
        runner.execute(step)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        runner.execute(step)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def breakdown(runner: ModelRunner, step: list[BatchItem], n: int = 10) -> dict[str, tuple[float, float]]:
    """kernel kind -> (GPU ms per step, launches per step), eager."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            runner.execute(step)
        torch.cuda.synchronize()
    us: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us[kind(e.name)] += e.device_time_total
            count[kind(e.name)] += 1
    return {k: (t / n / 1e3, count[k] / n) for k, t in us.most_common()}


def measure(loaded: LoadedModel, cfg: EngineConfig, linear: Linear, ctx: int) -> None:
    loaded.model.prepare_weights(linear)
    tokens = list(range(1, ctx + 2))
    blocks = list(range(-(-len(tokens) // cfg.block_size)))
    step = [BatchItem(tokens, ctx, 1, blocks, True)]
    for graphs in (True, False):
        runner = ModelRunner(loaded, dataclasses.replace(cfg, cuda_graphs=graphs), 128)
        runner.execute([BatchItem(tokens, 0, ctx, blocks, True)])
        print(f"{linear.name}: runner step, CUDA graphs {graphs}: {step_ms(runner, step, 50):.3f} ms")
        if not graphs:
            parts = breakdown(runner, step)
            total = sum(ms for ms, _ in parts.values())
            print(f"{linear.name}: eager GPU kernel time {total:.3f} ms/step")
            for k, (ms, n) in list(parts.items())[:10]:
                print(f"    {k:40s} {ms:7.3f} ms  x{n:4.0f}")
        runner.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--ctx", type=int, default=1024)
    args = ap.parse_args()
    dev = torch.device("cuda:0")
    bw = copy_bandwidth(dev)
    loaded = load_model(f"dummy:{args.shape}", device=dev, dtype=torch.bfloat16, seed=0)
    c = loaded.config
    weights = weight_bytes_read(loaded.model, c.tie_word_embeddings)
    kv = kv_bytes_per_token(c, torch.bfloat16) * args.ctx
    print(f"copy {bw / GIB:.0f} GiB/s; roofline step {(weights + kv) / bw * 1e3:.3f} ms")
    cfg = EngineConfig(model=loaded.source, device=str(dev), dtype="bfloat16", num_kv_blocks=128,
                       max_num_seqs=1, max_model_len=8192)  # fmt: skip
    for linear in (DenseLinear(), GemvLinear()):
        measure(loaded, cfg, linear, args.ctx)


if __name__ == "__main__":
    main()
