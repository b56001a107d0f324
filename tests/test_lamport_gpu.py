"""The Lamport all-reduce (kernels/triton_allreduce.py) compiled, between two GPUs through the real
`DistCollectives` (symmetric memory set up at `join`): the fused op equals NCCL's all-reduce then the add +
RMSNorm kernel for 1, 7 and 64 rows of Llama-3.1-8B's hidden size, eagerly and replayed from a CUDA graph
(the epoch advancing on the device, three calls per replay); the plain all-reduce equals NCCL's; and a rank
whose peer never pushes gives up after its polls and raises the error word. Skips below two GPUs."""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
import torch.multiprocessing as mp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.extras,  # needs triton, the [gpu] extra
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

HIDDEN = 4096
EPS = 1e-5


def _reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    from pdserve.kernels.triton_ops import TritonOps

    summed = x.clone()
    dist.all_reduce(summed)  # NCCL
    res = residual.clone()
    return TritonOps().add_rms_norm(summed, res, weight, EPS)


def _check(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert torch.equal(got[1], want[1]), "the residual differs"
    torch.testing.assert_close(got[0], want[0], rtol=1.6e-2, atol=1e-2)


def _worker(rank: int, port: int) -> None:
    from pdserve.kernels import triton_allreduce as ar
    from pdserve.kernels.triton_ops import TritonOps
    from pdserve.shared.engine.parallel.dist import DistCollectives

    dev = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(dev)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    comm = DistCollectives(rank, 2, dev)
    comm.join(store)
    assert comm._lamport is not None, "no Lamport buffers on two GPUs"
    ops = TritonOps()
    gen = torch.Generator(device=dev).manual_seed(100 + rank)  # each rank's partial differs
    shared = torch.Generator(device=dev).manual_seed(7)  # the residual and weight are the same everywhere
    weight = torch.randn(HIDDEN, device=dev, generator=shared).to(torch.bfloat16)
    for rows in (1, 7, 64):
        for _ in range(3):
            x = torch.randn(rows, HIDDEN, device=dev, generator=gen).to(torch.bfloat16)
            residual = torch.randn(rows, HIDDEN, device=dev, generator=shared).to(torch.bfloat16)
            want = _reference(x, residual, weight)
            got = comm.all_reduce_add_rms_norm(x.clone(), residual.clone(), weight, EPS, ops)
            _check(got, want)
            plain = x.clone()
            nccl = x.clone()
            dist.all_reduce(nccl)
            assert torch.equal(comm.all_reduce(plain), nccl)
    # a CUDA graph of three fused calls over static buffers, replayed with new inputs
    rows = 7
    xs = [torch.zeros(rows, HIDDEN, device=dev, dtype=torch.bfloat16) for _ in range(3)]
    residual = torch.zeros(rows, HIDDEN, device=dev, dtype=torch.bfloat16)
    outs: list[torch.Tensor] = []

    def body() -> None:
        outs.clear()
        for x in xs:
            outs.append(comm.all_reduce_add_rms_norm(x, residual, weight, EPS, ops)[0])

    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for _ in range(4):
        for x in xs:
            x.copy_(torch.randn(rows, HIDDEN, device=dev, generator=gen))
        start = torch.randn(rows, HIDDEN, device=dev, generator=shared).to(torch.bfloat16)
        residual.copy_(start)
        want_res, wants = start.clone(), []
        for x in xs:
            normed, want_res = _reference(x, want_res, weight)
            wants.append(normed)
        residual.copy_(start)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(residual, want_res), "the residual after a replay differs"
        for out, expect in zip(outs, wants, strict=True):
            torch.testing.assert_close(out, expect, rtol=1.6e-2, atol=1e-2)
    assert not comm._lamport.failed()
    # a rank alone: its spin gives up after its polls and says so (a first call compiles the kernel)
    buf = symm_mem.empty(2 * 2 * 1024, dtype=torch.int64, device=dev)
    group = dist.group.WORLD
    assert group is not None
    handle = symm_mem.rendezvous(buf, group)
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 0:
        x = torch.ones(2048, device=dev, dtype=torch.bfloat16)
        # 16 polls: Triton specialises an int argument by divisibility by 16, as it does 1 << 20
        ar.LamportState.create(buf, list(handle.buffer_ptrs), rank, 16).all_reduce(x)
        torch.cuda.synchronize()
        polls = 1 << 20
        lone = ar.LamportState.create(buf, list(handle.buffer_ptrs), rank, polls)
        t0 = time.perf_counter()
        lone.all_reduce(x)
        torch.cuda.synchronize()
        took = time.perf_counter() - t0
        assert lone.failed()
        per = took / polls * 1e9
        print(f"lone rank: gave up after {polls} polls in {took * 1e3:.1f} ms ({per:.0f} ns a poll)")
    dist.barrier()
    comm.close()


def test_lamport_fused_all_reduce_on_two_gpus() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port,), nprocs=2)
