"""Per-frame host cost of the KV-transfer protocol: P and D in two processes, host memory, small payloads.

A program, not a test: `python benchmarks/kv_transfer_frames.py [--kinds tcp ucx] [--reps 5]
[--profile sender|receiver]`. On a GPU link a 512 MiB frame is bandwidth-bound, but every frame also pays
a fixed host cost (header codec, posting the payload, asyncio hops, the ACK round trip); this measures that
cost alone, with payloads so small (4 KiB per layer-block) that the bytes barely count. Patterns:
- `1024 x 4 KiB`: one transfer of 32 layers x 32 blocks sent one (layer, block) per frame;
- `32 x 64 blk`: per-layer streaming of a 64-block prompt (32 frames of 256 KiB), 10 transfers.
Printed per pattern (median of `--reps` runs): frames/s and us per frame end to end (OPEN reply excluded,
first DATA send to D's ACK), P's time inside `send_layers` (encode + send) and its CPU, the ACK wait
(COMPLETE sent -> ACK back, which includes D draining frames still queued), and D's CPU per frame split
into frame receive + header decode (`FramedConnection.recv`), dispatch + checks (`_dispatch` less the
handler) and the handler's `on_data` (a scatter into a paged cache by the reference op). D's split is
thread CPU time, measured by wrappers that cost about 1 us per frame themselves.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import platform
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch
from pdserve.kernels.reference import ReferenceOps
from pdserve.kvtransfer.connector import (
    ConnectorConfig,
    FrameBlocks,
    KVLayout,
    OpenReply,
    PeerIdentity,
    TransferSession,
    create_sender,
    create_server,
)
from pdserve.kvtransfer.framing import FramedConnection
from pdserve.kvtransfer.receiver import ChannelServer
from pdserve.shared.types import BlockHash, BlockId, NodeId, RequestId

LAYOUT = KVLayout(num_layers=32, num_kv_heads=2, head_dim=32, block_size=16, dtype="bfloat16")  # 4 KiB
TOKEN = "bench-token"
CACHE_BLOCKS = 256
PATTERNS: dict[str, tuple[int, int, int]] = {  # name -> (blocks, blocks per frame, transfers)
    "1024 x 4 KiB": (32, 1, 1),
    "32 x 64 blk": (64, 64, 10),
}


def config(kind: str) -> ConnectorConfig:
    return ConnectorConfig(kind=kind, auth_token=TOKEN, handshake_timeout_s=20.0)


def identity(node: str) -> PeerIdentity:
    return PeerIdentity(NodeId(node), b"\x42" * 32, LAYOUT)


class CpuMeter:
    """Thread CPU seconds and calls spent inside wrapped coroutines (nested meters both count)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def wrap(self, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def timed(*args: Any) -> Any:
            t0 = time.thread_time()
            try:
                return await fn(*args)
            finally:
                self.seconds += time.thread_time() - t0
                self.calls += 1

        return timed


class SinkReceiver:
    """D's handler: a paged cache with a free list; on_data scatters like the decode node (reference op)."""

    def __init__(self, meter: CpuMeter) -> None:
        shape = (LAYOUT.num_layers, 2, CACHE_BLOCKS, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
        self.kv = torch.zeros(shape, dtype=LAYOUT.torch_dtype)
        self.free = list(range(CACHE_BLOCKS))
        self.reserved: dict[str, list[int]] = {}
        self.ops = ReferenceOps()
        self.meter = meter

    async def on_open(
        self, peer: NodeId, tid: RequestId, hashes: tuple[BlockHash, ...], num_blocks: int, deadline: float
    ) -> OpenReply:
        ids = [self.free.pop() for _ in range(num_blocks)]
        self.reserved[tid] = ids
        return OpenReply(0, tuple(BlockId(b) for b in ids))

    async def on_data(
        self, tid: RequestId, layer_start: int, dst: torch.Tensor, buffer: torch.Tensor
    ) -> None:
        t0 = time.thread_time()
        for i in range(buffer.shape[0]):
            self.ops.scatter_blocks(buffer[i], self.kv[layer_start + i], dst)
        self.meter.seconds += time.thread_time() - t0
        self.meter.calls += 1

    async def on_complete(self, tid: RequestId, first_token: dict[str, Any]) -> None:
        self.free.extend(self.reserved.pop(tid))

    async def on_abort(self, tid: RequestId, reason: str) -> None:
        self.free.extend(self.reserved.pop(tid))

    async def on_peer_silent(self, peer: NodeId, reason: str) -> None:
        return None


async def serve(kind: str, profile: bool) -> None:
    """D: serve until stdin closes; `reset` zeroes the meters, `stats` prints them as one JSON line."""
    meters = {name: CpuMeter() for name in ("recv", "dispatch", "on_data")}
    FramedConnection.recv = meters["recv"].wrap(FramedConnection.recv)  # type: ignore[method-assign,assignment]
    ChannelServer._dispatch = meters["dispatch"].wrap(ChannelServer._dispatch)  # type: ignore[method-assign,assignment]
    server = create_server(config(kind), identity("bench-decode"), SinkReceiver(meters["on_data"]))
    await server.start()
    print("ADDR", server.address, flush=True)
    loop = asyncio.get_running_loop()
    profiler = cProfile.Profile() if profile else None
    cpu0 = time.process_time()
    while line := (await loop.run_in_executor(None, sys.stdin.readline)).strip():
        if line == "reset":
            for m in meters.values():
                m.seconds, m.calls = 0.0, 0
            cpu0 = time.process_time()
            if profiler is not None:
                profiler.enable()
            print("OK", flush=True)
        elif line == "stats":
            cpu = time.process_time() - cpu0
            if profiler is not None:
                profiler.disable()
                pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(25)
                profiler = cProfile.Profile()
            stats = {name: [m.seconds, m.calls] for name, m in meters.items()} | {"cpu": cpu}
            print("STATS", json.dumps(stats), flush=True)
    await server.stop()


async def one_transfer(session: TransferSession, blocks: int, per_frame: int) -> tuple[float, float, int]:
    """(seconds inside send_layers, seconds waiting for ACK, frames) of one transfer."""
    reply = await session.open([], blocks, time.time() + 60)
    frame_blocks = [
        FrameBlocks.run(reply, b0, [BlockId(i) for i in range(b0, min(b0 + per_frame, blocks))])
        for b0 in range(0, blocks, per_frame)
    ]
    # buffers: [2, n, B, Hkv, D] per frame, made before the clock starts
    bufs = [
        torch.randn(2, per_frame, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim).to(torch.bfloat16)
        for _ in range(0, blocks, per_frame)
    ]
    sending, frames = 0.0, 0
    for layer in range(LAYOUT.num_layers):
        for j in range(len(frame_blocks)):
            t0 = time.perf_counter()
            await session.send_layers(layer, frame_blocks[j], bufs[j])
            sending += time.perf_counter() - t0
            frames += 1
    t0 = time.perf_counter()
    await session.complete({"token_id": 1})
    return sending, time.perf_counter() - t0, frames


def command(proc: subprocess.Popen[str], line: str | None, answer: str) -> str:
    """Send `line` to D (None: send nothing) and return what follows `answer` in D's reply."""
    assert proc.stdin is not None and proc.stdout is not None
    if line is not None:
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
    for out in proc.stdout:
        if out.startswith(answer):
            return out[len(answer) :].strip()
    raise RuntimeError(f"receiver exited (rc={proc.wait()}) before answering {line!r}")


async def measure(kind: str, reps: int, profile: str | None) -> list[dict[str, Any]]:
    args = [sys.executable, __file__, "--serve", kind] + (
        ["--profile", "receiver"] if profile == "receiver" else []
    )
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    rows = []
    try:
        address = command(proc, None, "ADDR ")
        sender = create_sender(config(kind), identity("bench-prefill"))
        counter = 0
        for name, (blocks, per_frame, transfers) in PATTERNS.items():
            runs = []
            for rep in range(reps + 1):  # the first run warms up (connection, allocator, code paths)
                command(proc, "reset", "OK")
                profiler = cProfile.Profile() if profile == "sender" and rep == reps else None
                cpu0, sending, acking, frames = time.process_time(), 0.0, 0.0, 0
                if profiler is not None:
                    profiler.enable()
                for _ in range(transfers):
                    counter += 1
                    session = await sender.session(address, RequestId(f"t{counter}"))
                    s, a, f = await one_transfer(session, blocks, per_frame)
                    sending, acking, frames = sending + s, acking + a, frames + f
                cpu = time.process_time() - cpu0
                if profiler is not None:
                    profiler.disable()
                    pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(25)
                d = json.loads(command(proc, "stats", "STATS "))
                if rep:
                    runs.append((sending + acking, cpu, sending, acking, frames, d))
            rows.append(summarize(kind, name, transfers, runs))
        await sender.close()
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=30)
    return rows


def summarize(kind: str, name: str, transfers: int, runs: list[tuple[Any, ...]]) -> dict[str, Any]:
    def med(values: list[float]) -> float:
        return statistics.median(values)

    us = 1e6
    frames = runs[0][4]
    d_recv = med([r[5]["recv"][0] for r in runs]) / frames * us
    d_dispatch_all = med([r[5]["dispatch"][0] for r in runs]) / frames * us
    d_on_data = med([r[5]["on_data"][0] for r in runs]) / frames * us
    transfer = med([r[0] for r in runs])
    return {
        "connector": kind,
        "pattern": name,
        "frames": frames,
        "frames_per_s": frames / transfer,
        "us_per_frame": transfer / frames * us,
        "p_send_us": med([r[2] for r in runs]) / frames * us,
        "p_cpu_us": med([r[1] for r in runs]) / frames * us,
        "ack_wait_us": med([r[3] for r in runs]) / transfers * us,
        "d_cpu_us": med([r[5]["cpu"] for r in runs]) / frames * us,
        "d_recv_us": d_recv,
        "d_dispatch_us": d_dispatch_all - d_on_data,
        "d_on_data_us": d_on_data,
    }


def table(rows: list[dict[str, Any]]) -> str:
    cols = [
        ("connector", "connector", "{}"),
        ("pattern", "pattern", "{}"),
        ("frames/s", "frames_per_s", "{:.0f}"),
        ("us/frame", "us_per_frame", "{:.1f}"),
        ("P send us", "p_send_us", "{:.1f}"),
        ("P cpu us", "p_cpu_us", "{:.1f}"),
        ("ACK wait us/transfer", "ack_wait_us", "{:.0f}"),
        ("D cpu us", "d_cpu_us", "{:.1f}"),
        ("D recv+decode", "d_recv_us", "{:.1f}"),
        ("D dispatch", "d_dispatch_us", "{:.1f}"),
        ("D on_data", "d_on_data_us", "{:.1f}"),
    ]
    lines = ["| " + " | ".join(c[0] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(fmt.format(r[key]) for _, key, fmt in cols) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", nargs="+", default=["tcp", "ucx"], choices=["tcp", "ucx"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--profile", choices=["sender", "receiver"], help="cProfile one side (slower)")
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # internal: run as D for this connector
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.serve:
        asyncio.run(serve(args.serve, args.profile == "receiver"))
        return
    rows = [row for kind in args.kinds for row in asyncio.run(measure(kind, args.reps, args.profile))]
    print(
        f"# {platform.node()} {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}; median of {args.reps} runs; us per frame"
    )
    print(table(rows))


if __name__ == "__main__":
    main()
