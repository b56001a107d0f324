"""All-reduce at tensor-parallel decode sizes between two GPUs of one host: NCCL against torch's symmetric
memory one-shot all-reduce (each rank reads its peer's buffer over NVLink; no multicast) and the Lamport
all-reduce of kernels/triton_allreduce.py (each rank pushes into its peer's buffer, no barrier), eager and
replayed from a CUDA graph; and the Lamport kernel fused with the residual add + RMSNorm (rows of 4,096)
against the one-shot all-reduce then the add + RMSNorm kernel. Prints one markdown table (rank 0).

    python benchmarks/tp_allreduce.py [--sizes-kib 8,16,32,64,256] [--calls 64]

A decode step of TP=2 Llama-3.1-8B runs 64 all-reduces of one token's hidden state per token of the batch
(8 KiB at batch 1, bf16); the per-call time in a graph is what the step pays. Timings are per call, medians
over 20 replays of `--calls` calls; the ranks run in lock step because each call waits for its peer.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _time(fn: Callable[[], object], reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _graph(body: Callable[[], object]) -> Callable[[], object]:
    body()  # warm outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph.replay


def _measure(n: int, calls: int, dev: torch.device, group: dist.ProcessGroup) -> dict[str, str]:
    """Per-call microseconds of each all-reduce of n bf16 values (or what failed)."""
    import torch.distributed._symmetric_memory as symm_mem

    x = torch.ones(n, dtype=torch.bfloat16, device=dev)
    res: dict[str, str] = {}

    def nccl() -> None:
        for _ in range(calls):
            dist.all_reduce(x)

    try:
        res["nccl eager"] = f"{_time(nccl, 10) / calls * 1e6:.1f}"
        res["nccl graph"] = f"{_time(_graph(nccl), 20) / calls * 1e6:.1f}"
    except Exception as exc:
        res["nccl graph"] = f"failed: {' '.join(str(exc).split())[:80]}"
    try:
        name = group.group_name
        x.fill_(1.0)  # the NCCL rows summed into it
        buf = symm_mem.empty(n, dtype=torch.bfloat16, device=dev)
        symm_mem.rendezvous(buf, group)
        out = torch.empty_like(x)

        def one_shot() -> None:
            for _ in range(calls):
                buf.copy_(x)
                torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", name, out)

        res["symm one-shot eager"] = f"{_time(one_shot, 10) / calls * 1e6:.1f}"
        res["symm one-shot graph"] = f"{_time(_graph(one_shot), 20) / calls * 1e6:.1f}"
        torch.testing.assert_close(out.float(), torch.full((n,), 2.0, device=dev))
    except Exception as exc:
        res["symm one-shot graph"] = f"failed: {' '.join(str(exc).split())[:120]}"
    try:
        res.update(_lamport(n, calls, dev, group))
    except Exception as exc:
        res["lamport graph"] = f"failed: {' '.join(str(exc).split())[:120]}"
    return res


def _lamport(n: int, calls: int, dev: torch.device, group: dist.ProcessGroup) -> dict[str, str]:
    """The Lamport all-reduce alone, and fused with add + RMSNorm over rows of 4,096 against the one-shot
    all-reduce followed by the add + RMSNorm kernel (what the model ran before), per call."""
    import torch.distributed._symmetric_memory as symm_mem
    from pdserve.kernels.triton_allreduce import LamportState
    from pdserve.kernels.triton_ops import TritonOps

    buf = symm_mem.empty(2 * 2 * (n // 2), dtype=torch.int64, device=dev)
    handle = symm_mem.rendezvous(buf, group)
    st = LamportState.create(buf, list(handle.buffer_ptrs), group.rank(), 1 << 24)
    torch.cuda.synchronize()
    dist.barrier()
    x = torch.ones(n, dtype=torch.bfloat16, device=dev)
    res: dict[str, str] = {}

    def plain() -> None:
        for _ in range(calls):
            st.all_reduce(x)

    res["lamport eager"] = f"{_time(plain, 10) / calls * 1e6:.1f}"
    res["lamport graph"] = f"{_time(_graph(plain), 20) / calls * 1e6:.1f}"
    x.fill_(1.0)
    st.all_reduce(x)
    torch.testing.assert_close(x.float(), torch.full((n,), 2.0, device=dev))
    rows = n // 4096
    if rows == 0:
        return res
    ops = TritonOps()
    part = torch.full((rows, 4096), 0.01, dtype=torch.bfloat16, device=dev)
    residual = torch.zeros(rows, 4096, dtype=torch.bfloat16, device=dev)
    weight = torch.ones(4096, dtype=torch.bfloat16, device=dev)
    one = symm_mem.empty(n, dtype=torch.bfloat16, device=dev)
    symm_mem.rendezvous(one, group)
    name = group.group_name

    def fused() -> None:
        for _ in range(calls):
            st.all_reduce_add_rms_norm(part, residual, weight, 1e-5)

    def separate() -> None:
        for _ in range(calls):
            one.copy_(part.view(-1))
            torch.ops.symm_mem.one_shot_all_reduce_out(one, "sum", name, part.view(-1))
            ops.add_rms_norm(part, residual, weight, 1e-5)

    res["lamport+norm graph"] = f"{_time(_graph(fused), 20) / calls * 1e6:.1f}"
    try:
        res["one-shot, add+norm graph"] = f"{_time(_graph(separate), 20) / calls * 1e6:.1f}"
    except RuntimeError as exc:
        res["one-shot, add+norm graph"] = f"failed: {' '.join(str(exc).split())[:80]}"
    assert not st.failed()
    return res


def _worker(rank: int, port: int, sizes_kib: list[int], calls: int) -> None:
    dev = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            device_id=dev)  # fmt: skip
    group = dist.group.WORLD
    assert group is not None
    rows = [(kib, _measure(kib * 1024 // 2, calls, dev, group)) for kib in sizes_kib]
    if rank == 0:
        cols = [
            "nccl eager",
            "nccl graph",
            "symm one-shot eager",
            "symm one-shot graph",
            "lamport eager",
            "lamport graph",
            "lamport+norm graph",
            "one-shot, add+norm graph",
        ]
        print(f"| size | {' | '.join(c + ' (us/call)' for c in cols)} |")
        print("|---|" + "---|" * len(cols))
        for kib, res in rows:
            print(f"| {kib} KiB | {' | '.join(res.get(c, '') for c in cols)} |", flush=True)
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-kib", default="8,16,32,64,128,256,512")
    p.add_argument("--calls", type=int, default=64)
    args = p.parse_args()
    if torch.cuda.device_count() < 2:
        print("tp_allreduce: needs two GPUs")
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sizes = [int(k) for k in args.sizes_kib.split(",")]
    mp.spawn(_worker, args=(port, sizes, args.calls), nprocs=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
