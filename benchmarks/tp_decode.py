"""Decode at tensor-parallel size 1 and 2 through the engine loop on one host's GPUs, against the HBM
roofline of the bytes each rank reads per step, and NCCL's all-reduce at decode sizes in a CUDA graph.
Prints one markdown table; `--out` gets the JSON.

    python benchmarks/tp_decode.py --shape llama-3.1-8b --tp 1,2
    python benchmarks/tp_decode.py --shape llama-3.1-70b --tp 2

Each engine loads its own seeded dummy weights (rank r draws its shard of the same model); async scheduling
is off at every size, because the engine refuses it at TP > 1 (TP=1 with it on is reported beside, as the
single GPU's best). Batch-1 decode runs at ~1.2k context, throughput at batch 64 and 2k context. The
roofline of TP=N: the copy bandwidth of one GPU over the bytes one rank reads per step (its weight shard,
the embedding table excepted, plus its KV heads' share), since the N GPUs read in parallel. The all-reduce
row times `--layers` x 2 all-reduces of one token's hidden state (bf16) replayed from a CUDA graph over
two processes, the cost a TP=2 decode step pays for its collectives.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pdserve.benchmarks.gpu_decode import (
    copy_bandwidth,
    engine_decode,
    kv_bytes_per_token,
    log,
    markdown,
    random_tokens,
    release,
)
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import LLMEngine
from pdserve.shared.model.model_config import NAMED_SHAPES

Row = tuple[str, str, str, str]


def _weight_bytes(shape: str, tp: int) -> int:
    """Bytes one rank's weights take per step at TP=tp: every sharded matrix / tp, norms whole, the
    embedding table not read (its LM-head twin is, when tied), bf16."""
    c = NAMED_SHAPES[shape]
    h, i, d = c.hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_heads * d, max(1, c.num_kv_heads // tp) * d * tp
    per_layer = h * (q + 2 * kv) // tp + q * h // tp + 3 * h * i // tp + 2 * h
    lm_head = c.vocab_size * h // tp
    return 2 * (c.num_layers * per_layer + lm_head + h)


def _allreduce_worker(rank: int, port: int, hidden: int, calls: int, out: dict[str, float]) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.ones(hidden, dtype=torch.bfloat16, device=f"cuda:{rank}")
    for _ in range(3):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                dist.all_reduce(x)
    times = []
    for _ in range(20):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    eager = []
    for _ in range(5):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        eager.append(time.perf_counter() - t0)
    if rank == 0:
        out["graph_us"] = statistics.median(times) / calls * 1e6
        out["eager_us"] = statistics.median(eager) / calls * 1e6
    dist.destroy_process_group()


def allreduce_us(hidden: int, calls: int) -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_allreduce_worker, args=(port, hidden, calls, out), nprocs=2)
    return dict(out)


def decode_rows(shape: str, tp: int, overlap: bool, bw: float, res: dict[str, object]) -> list[Row]:
    c = NAMED_SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    cfg = EngineConfig(model=f"dummy:{shape}", device="cuda", dtype="bfloat16", max_num_seqs=64,
                       max_num_batched_tokens=8192, max_model_len=8192, tensor_parallel_size=tp,
                       async_scheduling=overlap, gpu_memory_utilization=0.90)  # fmt: skip
    log(f"{shape} TP={tp} async={'on' if overlap else 'off'}: loading")
    engine = LLMEngine(cfg)
    try:
        prompt = random_tokens(1024, c.vocab_size, gen)
        skip, n_out = 8, 257
        ctx = 1024 + (skip + n_out) / 2
        kv = kv_bytes_per_token(c, torch.bfloat16) * ctx / min(tp, c.num_kv_heads)
        roof = bw / (_weight_bytes(shape, tp) + kv)
        b1 = [engine_decode(engine, [prompt], n_out, skip)[0] for _ in range(3)]
        prompts = [random_tokens(2048, c.vocab_size, gen) for _ in range(64)]
        b64 = engine_decode(engine, prompts, 16 + 40, 4)[0]
        kv64 = kv_bytes_per_token(c, torch.bfloat16) * (2048 + 30) * 64 / min(tp, c.num_kv_heads)
        roof64 = 64 * bw / (_weight_bytes(shape, tp) + kv64)
    finally:
        engine.close()
        release(torch.device("cuda:0"))
    rate = statistics.median(b1)
    key = f"{shape}/tp{tp}/async-{'on' if overlap else 'off'}"
    res[key] = {"b1": b1, "b64": b64, "roof_b1": roof, "roof_b64": roof64}
    mode = "on" if overlap else "off"
    return [
        (f"{shape} TP={tp} async {mode}: batch-1 decode tok/s at ~{ctx:.0f} ctx (median of 3)", f"{rate:.1f}",
         f"roofline {roof:.1f}", f"{rate / roof:.1%}"),
        (f"{shape} TP={tp} async {mode}: batch 64 at 2k ctx, tok/s", f"{b64:.0f}", f"roofline {roof64:.0f}",
         f"{b64 / roof64:.1%}"),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(NAMED_SHAPES))
    parser.add_argument("--tp", default="1,2", help="comma-separated TP sizes")
    parser.add_argument("--tp1-async", action="store_true", help="also TP=1 with async scheduling on")
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
    res: dict[str, object] = {"copy_bytes_per_s": bw, "gpu": torch.cuda.get_device_name(0)}
    rows: list[Row] = [("copy bandwidth, cuda:0", f"{bw / (1 << 30):.0f} GiB/s", "", "")]
    c = NAMED_SHAPES[args.shape]
    if max(sizes) >= 2:
        ar = allreduce_us(c.hidden_size, 2 * c.num_layers)
        res["allreduce"] = ar
        per_step_ms = ar["graph_us"] * 2 * c.num_layers / 1000
        rows.append((f"NCCL all-reduce of {c.hidden_size * 2 // 1024} KiB, 2 GPUs, per call",
                     f"{ar['graph_us']:.1f} us in a graph", f"{ar['eager_us']:.1f} us eager",
                     f"x{2 * c.num_layers} per step = {per_step_ms:.2f} ms"))  # fmt: skip
    for tp in sizes:
        rows += decode_rows(args.shape, tp, False, bw, res)
        if tp == 1 and args.tp1_async:
            rows += decode_rows(args.shape, 1, True, bw, res)
    got = {int(k.split("/tp")[1].split("/")[0]): v for k, v in res.items() if "/tp" in k and "async-off" in k}
    if 1 in got and 2 in got:
        b1 = statistics.median(got[2]["b1"]) / statistics.median(got[1]["b1"])  # type: ignore[index]
        b64 = got[2]["b64"] / got[1]["b64"]  # type: ignore[index]
        rows.append((f"{args.shape} TP=2 / TP=1 (async off both)", f"batch 1 {b1:.2f}x, batch 64 {b64:.2f}x",
                     "targets 1.6x / 1.7x", ""))  # fmt: skip
    print(markdown(rows))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
