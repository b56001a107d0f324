"""Does tearing an nccl pair down stall the nodes' event loops? P (GPU0) and D (GPU1) in two processes.

A program, not a test: `python benchmarks/pair_teardown.py` on a machine with two GPUs. P moves one
transfer (16 blocks of the Llama-3.1-8B KV shape) to D over the nccl connector, then closes its sender,
which tears the pair's communicator down on both ends. Each end runs a task that ticks every millisecond
during the teardown and reports the worst gap between ticks: how long the node could not serve anything
else. ncclCommAbort itself takes about 0.5 s, so a gap near that means it ran on the event loop. Both ends
also report the pair groups left (0 after `wait_aborted`).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from typing import Any

import torch
from pdserve.kvtransfer.connector import (
    ConnectorConfig,
    FrameBlocks,
    KVLayout,
    OpenReply,
    PeerIdentity,
    create_sender,
    create_server,
)
from pdserve.kvtransfer.pair_group import live_groups, wait_aborted
from pdserve.shared.types import BlockHash, BlockId, NodeId, RequestId

LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
BLOCKS = 16


class Sink:
    """D's handler: reserves ids 0..n-1 and keeps nothing (the teardown is what is measured)."""

    async def on_open(
        self, peer: NodeId, tid: RequestId, hashes: tuple[BlockHash, ...], n: int, deadline: float
    ) -> OpenReply:
        return OpenReply(0, tuple(BlockId(i) for i in range(n)))

    async def on_data(self, tid: RequestId, layer: int, dst: torch.Tensor, buf: torch.Tensor) -> None:
        return None

    async def on_complete(self, tid: RequestId, first_token: dict[str, Any]) -> None:
        return None

    async def on_abort(self, tid: RequestId, reason: str) -> None:
        return None

    async def on_peer_silent(self, peer: NodeId, reason: str) -> None:
        return None


def config(device: str) -> ConnectorConfig:
    return ConnectorConfig(
        kind="nccl", auth_token="bench", checksum=False, device=device, handshake_timeout_s=60
    )


def identity(name: str) -> PeerIdentity:
    return PeerIdentity(NodeId(name), b"\x01" * 32, LAYOUT)


class Ticker:
    """Ticks every millisecond on the running loop and keeps the gaps between ticks."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self.gaps.append(now - last)
            last = now

    def stop(self) -> float:
        """The worst gap in ms."""
        self.task.cancel()
        return max(self.gaps) * 1e3


async def receiver() -> None:
    torch.cuda.set_device("cuda:1")
    server = create_server(config("cuda:1"), identity("bench-d"), Sink())
    await server.start()
    print("ADDR " + server.address, flush=True)
    await asyncio.to_thread(sys.stdin.readline)  # P moved its transfer and now closes
    ticker = Ticker()
    await asyncio.sleep(1.5)
    worst = ticker.stop()
    await asyncio.to_thread(wait_aborted, 5.0)
    print("D " + json.dumps({"worst_gap_ms": worst, "live_groups": live_groups()}), flush=True)
    await server.stop()


async def sender(address: str, d: subprocess.Popen[str]) -> dict[str, Any]:
    torch.cuda.set_device("cuda:0")
    kv_sender = create_sender(config("cuda:0"), identity("bench-p"))
    buf = torch.zeros((LAYOUT.num_layers, 2, BLOCKS, 16, 8, 128), dtype=torch.bfloat16, device="cuda:0")
    session = await kv_sender.session(address, RequestId("one"))
    reply = await session.open([], BLOCKS, time.time() + 60)
    await session.send_layers(0, FrameBlocks.run(reply, 0, [BlockId(i) for i in range(BLOCKS)]), buf)
    await session.complete({"token_id": 1})
    assert d.stdin is not None
    d.stdin.write("\n")
    d.stdin.flush()
    await asyncio.sleep(0.2)
    ticker = Ticker()
    t0 = time.perf_counter()
    await kv_sender.close()
    took = time.perf_counter() - t0
    await asyncio.sleep(0.05)
    return {"close_s": took, "worst_gap_ms": ticker.stop(), "live_groups": live_groups()}


def main() -> None:
    if sys.argv[1:] == ["--receiver"]:
        asyncio.run(receiver())
        return
    assert torch.cuda.device_count() >= 2, "needs two GPUs"
    d = subprocess.Popen(
        [sys.executable, __file__, "--receiver"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert d.stdout is not None
    address = next(line for line in d.stdout if line.startswith("ADDR ")).split()[1]
    p = asyncio.run(sender(address, d))
    d_line = next(line for line in d.stdout if line.startswith("D "))
    d.wait(timeout=30)
    print("| end | worst event-loop gap during teardown (ms) | pair groups left |")
    print("|---|---:|---:|")
    print(f"| P (close took {p['close_s'] * 1e3:.0f} ms) | {p['worst_gap_ms']:.1f} | {p['live_groups']} |")
    dd = json.loads(d_line[2:])
    print(f"| D | {dd['worst_gap_ms']:.1f} | {dd['live_groups']} |")


if __name__ == "__main__":
    main()
