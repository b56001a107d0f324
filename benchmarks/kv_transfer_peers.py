"""The two GPU processes of benchmarks/kv_transfer.py: `recv` (D, serves everything) and `send` (P, times).

Both sides know the plan (sizes, repetitions, transfer ids) from the command line, so raw NCCL and raw ucxx
need no control messages: message k on one side meets message k on the other. Paged caches use the
Llama-3.1-8B shape (32 layers, 8 KV heads, head dim 128, bf16, block size 16); P's cache holds a value
pattern D can recompute, so D checks every transferred block bit for bit. Results are JSON lines on stdout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from pdserve.kernels.ops import get_ops
from pdserve.kvtransfer.connector import (
    ConnectorConfig,
    FrameBlocks,
    KVLayout,
    Open,
    OpenReply,
    PeerIdentity,
    TransferAborted,
    create_sender,
    create_server,
)
from pdserve.kvtransfer.cuda_ipc import live_windows
from pdserve.kvtransfer.device_sync import event_done
from pdserve.kvtransfer.nccl import NcclBackend
from pdserve.kvtransfer.pair_group import live_groups, wait_aborted
from pdserve.shared.types import BlockId, FirstToken, NodeId, RequestId

LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
CACHE_BLOCKS = 512  # per node: 1 GiB
PROMPT_BLOCKS = 256  # 4096 tokens
MIB = 1 << 20
SIZES = [512 * MIB, 16 * MIB]  # the whole 4k-token KV; one layer of it
WARMUP, REPS = 2, 10
TOKEN = "bench-token"


def emit(kind: str, **fields: Any) -> None:
    print(f"{kind} {json.dumps(fields)}", flush=True)


def config(kind: str, device: str) -> ConnectorConfig:
    return ConnectorConfig(
        kind=kind, auth_token=TOKEN, checksum=False, device=device, handshake_timeout_s=60.0
    )


def pattern_cache(device: torch.device) -> torch.Tensor:
    """P's cache: [L, 2, N, B, Hkv, D] bf16, a value pattern both processes can compute."""
    shape = (LAYOUT.num_layers, 2, CACHE_BLOCKS, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    flat = torch.arange(int(np.prod(shape)), device=device, dtype=torch.int64)
    return ((flat * 2654435761) % 65521 - 32760).to(torch.bfloat16).view(shape)


def src_blocks() -> list[int]:
    return torch.randperm(CACHE_BLOCKS, generator=torch.Generator().manual_seed(7))[:PROMPT_BLOCKS].tolist()


class BenchHandler:
    """D's TransferHandler over a paged cache; `sink-*` transfers skip the scatter (connector only)."""

    def __init__(self, device: torch.device, die_on_data: bool) -> None:
        self.kv = torch.zeros(
            (LAYOUT.num_layers, 2, CACHE_BLOCKS, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim),
            dtype=torch.bfloat16,
            device=device,
        )
        self.ops = get_ops(device)
        self.free = torch.randperm(CACHE_BLOCKS, generator=torch.Generator().manual_seed(3)).tolist()
        self.reserved: dict[str, list[int]] = {}
        self.verified: dict[str, bool] = {}
        self.die_on_data = die_on_data
        self.expected = pattern_cache(device)[:, :, torch.tensor(src_blocks(), device=device)]  # P's blocks

    async def on_open(self, peer: NodeId, req: Open) -> OpenReply:
        ids = [self.free.pop() for _ in range(req.num_blocks)]
        self.reserved[req.transfer_id] = ids
        return OpenReply(0, tuple(BlockId(b) for b in ids))

    async def on_data(
        self, tid: RequestId, layer_start: int, dst: torch.Tensor, buffer: torch.Tensor
    ) -> None:
        if self.die_on_data:
            os.kill(os.getpid(), signal.SIGKILL)
        if tid.startswith("sink-"):
            return
        ids = dst.to(self.kv.device)
        for i in range(buffer.shape[0]):  # a tcp buffer arrives in host memory
            self.ops.scatter_blocks(buffer[i].to(self.kv.device), self.kv[layer_start + i], ids)

    async def on_complete(self, tid: RequestId, first_token: FirstToken | None) -> None:
        ids = self.reserved.pop(tid)
        if tid.startswith("paged-"):  # checked after the ACK went out, outside the timed window
            asyncio.get_running_loop().call_soon(self.verify, tid, ids)
        else:
            self.free.extend(ids)

    def verify(self, tid: str, ids: list[int]) -> None:
        dst = torch.tensor(ids, device=self.kv.device)
        self.verified[tid] = bool(torch.equal(self.kv[:, :, dst], self.expected))
        self.kv[:, :, dst] = 0
        self.free.extend(ids)

    async def on_abort(self, tid: RequestId, reason: str) -> None:
        self.free.extend(self.reserved.pop(tid, []))

    async def on_peer_silent(self, peer: NodeId, reason: str) -> None:
        return None


def raw_nccl_recv(store: dist.Store, device: torch.device) -> None:
    torch.cuda.set_device(device)  # this runs in a worker thread
    group = NcclBackend().connect(dist.PrefixStore("raw", store), 0, device, 600.0)
    buf = torch.empty(max(SIZES), dtype=torch.uint8, device=device)
    ack = torch.ones(1, dtype=torch.uint8, device=device)
    for size in SIZES:
        for _ in range(WARMUP + REPS):
            group.recv(buf[:size]).wait()
            group.send(ack).wait()
            torch.cuda.synchronize(device)
    group.abort()


async def serve(device: torch.device, kinds: list[str], victim: bool) -> None:
    """D: a server per connector kind; a victim's dies at its first DATA."""
    async with contextlib.AsyncExitStack() as raw_context:
        await _serve(device, kinds, victim, raw_context)


async def _serve(
    device: torch.device, kinds: list[str], victim: bool, raw_context: contextlib.AsyncExitStack
) -> None:
    handler = BenchHandler(device, die_on_data=victim)
    identity = PeerIdentity(NodeId("bench-d"), b"\x01" * 32, LAYOUT)
    servers = {k: create_server(config(k, str(device)), identity, handler) for k in kinds}
    for server in servers.values():
        await server.start()
    ready: dict[str, Any] = {"servers": {k: s.address for k, s in servers.items()}}
    if not victim:
        if "ucx" in kinds:  # ucxx only where the ucx connector is measured (the [ucx] extra may be absent)
            ready["ucx_port"] = await raw_ucx_listener(device, raw_context)
        store = dist.TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=120), wait_for_workers=False)
        threading.Thread(target=raw_nccl_recv, args=(store, device), daemon=True).start()
        ready["nccl_port"] = store.port
    emit("READY", **ready)
    await asyncio.to_thread(sys.stdin.read)  # the driver closes stdin when the sender is done
    for server in servers.values():
        await server.stop()
    sync(device)
    await asyncio.to_thread(wait_aborted, 5.0)
    emit(
        "AUDIT",
        open_transfers=sum(len(s.open_transfer_ids()) for s in servers.values()),
        free_blocks=len(handler.free),
        total_blocks=CACHE_BLOCKS,
        live_groups=live_groups(),
        live_windows=live_windows(),
        verified=handler.verified,
        cuda_allocated_mib=torch.cuda.memory_allocated(device) / MIB,
    )


def gib_s(nbytes: int, seconds: list[float]) -> dict[str, Any]:
    med = statistics.median(seconds)
    every = [round(s * 1e3, 4) for s in seconds]
    return {"gib_s": nbytes / med / 2**30, "median_ms": med * 1e3, "reps": len(seconds), "ms": every}


def raw_nccl_send(port: int, device: torch.device) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=120))
    torch.cuda.set_device(device)  # this runs in a worker thread
    group = NcclBackend().connect(dist.PrefixStore("raw", store), 1, device, 600.0)
    buf = torch.randint(0, 255, (max(SIZES),), dtype=torch.uint8, device=device)
    ack = torch.empty(1, dtype=torch.uint8, device=device)
    for size in SIZES:
        times = []
        for rep in range(WARMUP + REPS):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            group.send(buf[:size]).wait()
            group.recv(ack).wait()
            torch.cuda.synchronize(device)
            if rep >= WARMUP:
                times.append(time.perf_counter() - t0)
        emit("RESULT", path="raw nccl send/recv", size=size, **gib_s(size, times))
    group.abort()


async def raw_ucx_listener(device: torch.device, raw_context: contextlib.AsyncExitStack) -> int:
    """D's raw ucxx endpoint (each message answered by a 1-byte ack); returns its port."""
    import ucxx
    from pdserve.kvtransfer.ucx_context import ucx_context

    buf = torch.empty(max(SIZES), dtype=torch.uint8, device=device)

    async def raw_ucx(ep: ucxx.Endpoint) -> None:
        ack = np.ones(1, dtype=np.uint8)
        for size in SIZES:
            for _ in range(WARMUP + REPS):
                await ep.recv(buf[:size])
                await ep.send(ack)
        await ep.close()

    # raw ucxx runs in the UCX context the connector uses, held until this process ends
    await raw_context.enter_async_context(ucx_context(config("ucx", str(device))))
    listener = ucxx.create_listener(raw_ucx, port=0)
    raw_context.callback(listener.close)
    return int(listener.port)


async def raw_ucx_send(port: int, device: torch.device) -> None:
    import ucxx

    ep = await ucxx.create_endpoint("127.0.0.1", port)
    buf = torch.randint(0, 255, (max(SIZES),), dtype=torch.uint8, device=device)
    torch.cuda.synchronize(device)
    ack = np.empty(1, dtype=np.uint8)
    for size in SIZES:
        times = []
        for rep in range(WARMUP + REPS):
            t0 = time.perf_counter()
            await ep.send(buf[:size])
            await ep.recv(ack)
            if rep >= WARMUP:
                times.append(time.perf_counter() - t0)
        emit("RESULT", path="raw ucxx send/recv", size=size, **gib_s(size, times))
    await ep.close()


async def push(
    sender: Any,
    address: str,
    tid: str,
    frames: list[tuple[int, list[int], torch.Tensor | None]],
    kv: torch.Tensor,
) -> tuple[float, float]:
    """Open PROMPT_BLOCKS blocks, send each (layer, block indices, buffer) frame (buffer None: gather that
    layer's blocks from kv first), complete. Returns (connector seconds first send->ACK, wall seconds)."""
    session = await sender.session(address, RequestId(tid))
    reply = await session.open([], PROMPT_BLOCKS, time.time() + 120)
    src = src_blocks()
    ops = get_ops(kv.device)
    t0 = time.perf_counter()
    for layer, indices, buf in frames:
        if buf is None:
            buf = torch.empty((2, len(indices), *kv.shape[3:]), dtype=kv.dtype, device=kv.device)
            ops.gather_blocks(kv[layer], torch.tensor([src[i] for i in indices], device=kv.device), buf)
            if buf.is_cuda:
                event = torch.cuda.Event()
                event.record()
                await event_done(event)
        src_ids = tuple(BlockId(src[i]) for i in indices)
        blocks = FrameBlocks(tuple(indices), src_ids, tuple(reply.dst_block_ids[i] for i in indices))
        await session.send_layers(layer, blocks, buf)
    stats = await session.complete(FirstToken(1))
    return stats.seconds, time.perf_counter() - t0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def drive(device: torch.device, ready: dict[str, Any], victims: dict[str, Any]) -> None:
    await asyncio.to_thread(raw_nccl_send, ready["nccl_port"], device)
    if "ucx_port" not in ready:
        await _drive(device, ready, victims)
        return
    from pdserve.kvtransfer.ucx_context import ucx_context

    async with ucx_context(config("ucx", str(device))):  # raw ucxx in the connector's UCX context
        await raw_ucx_send(ready["ucx_port"], device)
        await _drive(device, ready, victims)


async def _drive(device: torch.device, ready: dict[str, Any], victims: dict[str, Any]) -> None:
    kv = pattern_cache(device)
    await connectors(device, ready["servers"], kv)
    for kind in ready["servers"]:
        if kind != "tcp":
            await overlap(device, kind, ready["servers"][kind], kv)
    for kind, victim in victims.items():
        await kill_d_midway(device, kind, victim["servers"][kind], kv)
    await asyncio.to_thread(wait_aborted, 5.0)
    sync(device)  # raises if a dead peer left this process's CUDA context broken
    torch.cuda.empty_cache()  # buffers freed behind a copy stream's last use are counted only once processed
    emit(
        "SENDER_AUDIT",
        live_groups=live_groups(),
        live_windows=live_windows(),
        cuda_allocated_mib=torch.cuda.memory_allocated(device) / MIB,
    )


async def prefill_like(session: Any, kv: torch.Tensor, mode: str, weights: tuple[torch.Tensor, ...]) -> float:
    """Seconds from the first layer's compute to D's ACK (or to the end of compute for `compute only`).
    Each layer: four bf16 [4096 x 4096] @ [4096 x 14336] products (about an 8B layer on 4096 tokens),
    then its blocks are gathered; `per layer` sends each layer as soon as its gather is done while later
    layers compute, `one chunk` sends everything once compute is done."""
    x, w, y = weights
    ops, device = get_ops(kv.device), kv.device
    src = torch.tensor(src_blocks(), device=device)
    reply = None if mode == "compute only" else await session.open([], PROMPT_BLOCKS, time.time() + 120)
    p_blocks = [BlockId(b) for b in src_blocks()]
    blocks = FrameBlocks((), (), ()) if reply is None else FrameBlocks.run(reply, 0, p_blocks)
    chunk = torch.empty((LAYOUT.num_layers, 2, PROMPT_BLOCKS, *kv.shape[3:]), dtype=kv.dtype, device=device)
    queue: asyncio.Queue[tuple[int, torch.cuda.Event] | None] = asyncio.Queue()

    async def stream() -> None:
        while (item := await queue.get()) is not None:
            await event_done(item[1])
            await session.send_layers(item[0], blocks, chunk[item[0]])

    sync(device)
    t0 = time.perf_counter()
    task = asyncio.create_task(stream()) if mode == "per layer" else None
    for layer in range(LAYOUT.num_layers):
        for _ in range(4):
            torch.mm(x, w, out=y)
        if reply is not None:
            ops.gather_blocks(kv[layer], src, chunk[layer])
        if task is not None:
            event = torch.cuda.Event()
            event.record()
            queue.put_nowait((layer, event))
            await asyncio.sleep(0)
    if task is not None:
        queue.put_nowait(None)
        await task
    elif reply is not None:
        event = torch.cuda.Event()
        event.record()
        await event_done(event)
        await session.send_layers(0, blocks, chunk)
    if reply is None:
        sync(device)
    else:
        await session.complete(FirstToken(1))
    return time.perf_counter() - t0


async def overlap(device: torch.device, kind: str, address: str, kv: torch.Tensor) -> None:
    """The TTFT question: how much transfer time is left exposed after a prefill's compute."""
    weights = (
        torch.randn(4096, 4096, device=device, dtype=torch.bfloat16),
        torch.randn(4096, 14336, device=device, dtype=torch.bfloat16),
        torch.empty(4096, 14336, device=device, dtype=torch.bfloat16),
    )
    sender = create_sender(config(kind, str(device)), PeerIdentity(NodeId("bench-p"), b"\x01" * 32, LAYOUT))
    times: dict[str, list[float]] = {"compute only": [], "per layer": [], "one chunk": []}
    for rep in range(WARMUP + 5):
        for mode, seconds in times.items():
            session = await sender.session(address, RequestId(f"flow-{kind}-{mode}-{rep}"))
            took = await prefill_like(session, kv, mode, weights)
            if mode == "compute only":
                await session.abort("compute only")
            if rep >= WARMUP:
                seconds.append(took)
    compute = statistics.median(times["compute only"])
    for mode in ("per layer", "one chunk"):
        med = statistics.median(times[mode])
        emit(
            "OVERLAP",
            path=f"{kind}: prefill-like compute + {mode}",
            compute_ms=compute * 1e3,
            total_ms=med * 1e3,
            exposed_transfer_ms=(med - compute) * 1e3,
        )
    await sender.close()


async def connectors(device: torch.device, servers: dict[str, str], kv: torch.Tensor) -> None:
    src = src_blocks()
    everything = list(range(PROMPT_BLOCKS))
    one_chunk = torch.empty(
        (LAYOUT.num_layers, 2, PROMPT_BLOCKS, *kv.shape[3:]), dtype=kv.dtype, device=device
    )
    get_ops(device).gather_blocks(kv[0], torch.tensor(src, device=device), one_chunk[0])  # compile kernels
    counter = 0
    for kind, address in servers.items():
        sender = create_sender(
            config(kind, str(device)), PeerIdentity(NodeId("bench-p"), b"\x01" * 32, LAYOUT)
        )
        variants: dict[str, Any] = {
            "512 MiB, one frame, no gather/scatter": lambda: [(0, everything, one_chunk)],
            "4k-token KV paged, per layer (gather/scatter kernels)": lambda: [
                (layer, everything, None) for layer in range(LAYOUT.num_layers)
            ],
            "4k-token KV paged, one chunk (gather all, scatter all)": None,
        }
        if kind != "tcp":  # one frame per (layer, block): 8192 frames of 64 KiB, no gather kernel
            variants["4k-token KV paged, per block (8192 frames)"] = lambda: [
                (layer, [i], kv[layer, :, src[i] : src[i] + 1].contiguous())
                for layer in range(LAYOUT.num_layers)
                for i in everything
            ]
        for name, frames in variants.items():
            warmup, reps = (0, 2) if kind == "tcp" or "per block" in name else (WARMUP, REPS)
            seconds, walls = [], []
            for rep in range(warmup + reps):
                counter += 1
                tid = f"{'sink' if 'no gather' in name else 'paged'}-{kind}-{counter}"
                if frames is None:  # one chunk: the gathers are part of the wall time
                    sync(device)
                    t0 = time.perf_counter()
                    ids = torch.tensor(src, device=device)
                    for layer in range(LAYOUT.num_layers):
                        get_ops(device).gather_blocks(kv[layer], ids, one_chunk[layer])
                    sync(device)
                    s, _ = await push(sender, address, tid, [(0, everything, one_chunk)], kv)
                    w = time.perf_counter() - t0
                else:
                    fr = frames()
                    sync(device)
                    s, w = await push(sender, address, tid, fr, kv)
                    del fr
                if rep >= warmup:
                    seconds.append(s)
                    walls.append(w)
            nbytes = LAYOUT.num_layers * PROMPT_BLOCKS * LAYOUT.layer_block_bytes
            emit(
                "RESULT",
                path=f"connector {kind}: {name}",
                size=nbytes,
                **gib_s(nbytes, seconds),
                wall_gib_s=nbytes / statistics.median(walls) / 2**30,
            )
        await sender.close()


async def kill_d_midway(device: torch.device, kind: str, address: str, kv: torch.Tensor) -> None:
    """D dies at its first DATA: P's next send must fail promptly, not hang, and leave no group or window
    behind."""
    sender = create_sender(config(kind, str(device)), PeerIdentity(NodeId("bench-p"), b"\x01" * 32, LAYOUT))
    t0 = time.perf_counter()
    outcome = "completed (unexpected)"
    try:
        per_layer: list[tuple[int, list[int], torch.Tensor | None]] = [
            (n, list(range(PROMPT_BLOCKS)), None) for n in range(LAYOUT.num_layers)
        ]
        await push(sender, address, "victim", per_layer, kv)
    except TransferAborted as e:
        outcome = f"TransferAborted: {e.reason[:160]}"
    seconds = time.perf_counter() - t0
    await sender.close()
    await asyncio.to_thread(wait_aborted, 5.0)
    emit(
        "RESULT",
        path=f"{kind}: D killed mid-transfer",
        outcome=outcome,
        seconds=seconds,
        live_groups_after=live_groups(),
        live_windows_after=live_windows(),
    )


def main() -> None:
    role, device = sys.argv[1], torch.device(sys.argv[2])
    torch.cuda.set_device(device)
    torch.empty(1, device=device)  # the CUDA context exists before UCX starts
    if role in ("recv", "victim"):
        asyncio.run(serve(device, sys.argv[3].split(","), victim=role == "victim"))
    else:
        asyncio.run(drive(device, json.loads(sys.argv[3]), json.loads(sys.argv[4])))


if __name__ == "__main__":
    main()
