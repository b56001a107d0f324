"""One-off probe (issue 21): why does cuda_ipc move a 16k-token prefix (1,025 blocks x 32 layers, 2 GiB) at
~100 GiB/s between two processes on ONE GPU? Two processes (D `recv`, P `send`) on cuda:0, paged caches of the
Llama-3.1-8B shape; variants of the channel (GPU-side event waits as built, or host-side waits), window size
and frame size; raw peers (local copy, copy into the IPC window, gather kernel) in P's process.
`python benchmarks/ipc_one_gpu_probe.py` on a one-GPU machine.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import torch
from pdserve.kernels.ops import get_ops
from pdserve.kvtransfer import cuda_ipc
from pdserve.kvtransfer.common import ConnectionLost
from pdserve.kvtransfer.connector import (
    ConnectorConfig,
    CudaIpcOptions,
    FrameBlocks,
    KVLayout,
    OpenReply,
    OpenRequest,
    PeerIdentity,
)
from pdserve.kvtransfer.device_sync import event_done, on_stream, poll
from pdserve.kvtransfer.receiver import ChannelServer
from pdserve.kvtransfer.sender import ChannelSender
from pdserve.kvtransfer.tcp import ControlTransport
from pdserve.kvtransfer.window_ring import SLOTS
from pdserve.shared.types import BlockId, FirstToken, NodeId, RequestId

LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
N = 1025
CACHE = 1100
MIB = 1 << 20
REPS, WARM = 8, 2
# name, host_wait, window MiB, layers per frame
VARIANTS = [
    ("gpu-wait  w512  lpf4", False, 512, 4),
    ("host-wait w512  lpf4", True, 512, 4),
    ("gpu-wait  w2304 lpf4", False, 2304, 4),
    ("host-wait w2304 lpf4", True, 2304, 4),
    ("gpu-wait  w2304 lpf16", False, 2304, 16),
    ("host-wait w2304 lpf16", True, 2304, 16),
]


class HostWaitChannel(cuda_ipc.IpcChannel):
    """No GPU stream ever waits on the other process's event: each end polls it on the host instead."""

    async def _copy(self, payload: torch.Tensor) -> None:
        assert self._window is not None and self._stream is not None
        seq, offset, must = self._ring.place(payload.numel())
        if must >= 0 and self._released() <= must:
            await self._until(lambda: self._released() > must, time.perf_counter(), "window space")
        if must >= 0:
            freed = self._freed[must % SLOTS]
            if not freed.query():
                await poll(freed.query)
        with on_stream(self._stream):
            self._window.narrow(0, offset, payload.numel()).copy_(payload, non_blocking=True)
            self._copied[seq % SLOTS].record(self._stream)
        payload.record_stream(self._stream)

    async def recv_payload(self, nbytes: int) -> torch.Tensor:
        self._check()
        assert self._window is not None
        seq, offset, _ = self._ring.place(nbytes)
        self._held = (seq, torch.cuda.current_stream(self._device))
        self._last = seq
        return self._window[offset : offset + nbytes]

    def payload_landed(self) -> bool:
        return self._last is None or bool(self._copied[self._last % SLOTS].query())

    async def landed(self) -> None:
        if self._last is not None:
            await poll(self._copied[self._last % SLOTS].query)


def transport(config: ConnectorConfig, host_wait: bool) -> ControlTransport:
    cls = HostWaitChannel if host_wait else cuda_ipc.IpcChannel
    return ControlTransport("cuda_ipc", lambda control, rank, host: cls(control, rank, config))


def config(window_mib: int) -> ConnectorConfig:
    return ConnectorConfig(
        kind="cuda_ipc",
        auth_token="probe",
        checksum=False,
        device="cuda:0",
        handshake_timeout_s=60.0,
        max_payload_bytes=8 << 30,
        options=CudaIpcOptions(window_bytes=window_mib * MIB),
    )


def pattern(device: torch.device) -> torch.Tensor:
    shape = (LAYOUT.num_layers, 2, CACHE, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    kv = torch.empty(shape, dtype=torch.bfloat16, device=device)
    flat = kv.view(-1)
    step = 1 << 26
    for i in range(0, flat.numel(), step):
        n = min(step, flat.numel() - i)
        idx = torch.arange(i, i + n, device=device, dtype=torch.int64)
        flat[i : i + n] = ((idx * 2654435761) % 65521 - 32760).to(torch.bfloat16)
    return kv


SRC = torch.randperm(CACHE, generator=torch.Generator().manual_seed(7))[:N].tolist()
DST = torch.randperm(CACHE, generator=torch.Generator().manual_seed(3))[:N].tolist()


class Handler:
    def __init__(self, device: torch.device) -> None:
        self.kv = torch.zeros(
            (LAYOUT.num_layers, 2, CACHE, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim),
            dtype=torch.bfloat16,
            device=device,
        )
        self.ops = get_ops(device)
        self.checked: dict[str, bool] = {}

    async def on_open(self, req: OpenRequest) -> OpenReply:
        return OpenReply(0, tuple(BlockId(b) for b in DST))

    async def on_data(
        self, tid: RequestId, layer_start: int, dst: torch.Tensor, buffer: torch.Tensor
    ) -> None:
        if tid.startswith("sink"):
            return
        for i in range(buffer.shape[0]):
            self.ops.scatter_blocks(buffer[i], self.kv[layer_start + i], dst)

    async def on_complete(self, tid: RequestId, first_token: FirstToken | None) -> None:
        if tid.endswith("check"):
            exp = pattern(self.kv.device)[:, :, torch.tensor(SRC, device=self.kv.device)]
            self.checked[tid] = bool(
                torch.equal(self.kv[:, :, torch.tensor(DST, device=self.kv.device)], exp)
            )
            del exp
            self.kv.zero_()

    async def on_abort(self, tid: RequestId, reason: str) -> None:
        print("ABORT", tid, reason, file=sys.stderr, flush=True)

    async def on_peer_silent(self, peer: NodeId, reason: str) -> None:
        return None


async def recv() -> None:
    device = torch.device("cuda:0")
    handler = Handler(device)
    identity = PeerIdentity(NodeId("probe-d"), b"\x01" * 32, LAYOUT)
    servers = []
    addrs = {}
    for name, host_wait, window, _ in VARIANTS:
        cfg = config(window)
        s = ChannelServer(transport(cfg, host_wait), cfg, identity, handler)
        await s.start()
        servers.append(s)
        addrs[name] = s.address
    print("READY " + json.dumps(addrs), flush=True)
    await asyncio.to_thread(sys.stdin.read)
    for s in servers:
        await s.stop()
    print("CHECKED " + json.dumps(handler.checked), flush=True)


def timed(fn: Any, reps: int = 10) -> float:
    ts = []
    for _ in range(reps + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts[2:])


def busy(device: torch.device, n: int = 3000) -> float:
    """Host seconds to launch n tiny kernels from this thread (an engine thread's share of the GIL)."""
    x = torch.zeros(16, device=device)
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    return time.perf_counter() - t0


async def send(addrs: dict[str, str]) -> None:
    device = torch.device("cuda:0")
    kv = pattern(device)
    ops = get_ops(device)
    src = torch.tensor(SRC, device=device)
    frame_bytes = 4 * N * 64 * 1024
    out: dict[str, Any] = {}
    a = torch.empty(frame_bytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    out["raw local copy 256 MiB GiB/s (read)"] = frame_bytes / timed(lambda: b.copy_(a)) / 2**30
    buf = torch.empty((4, 2, N, 16, 8, 128), dtype=torch.bfloat16, device=device)

    def gather4() -> None:
        for i in range(4):
            ops.gather_blocks(kv[i], src, buf[i])

    out["gather 4 layers x 1025 blocks GiB/s (read)"] = frame_bytes / timed(gather4) / 2**30
    busy_times: list[float] = []
    out["busy thread alone ms"] = round(statistics.median([busy(device) for _ in range(5)]) * 1e3, 2)
    identity = PeerIdentity(NodeId("probe-p"), b"\x01" * 32, LAYOUT)
    full = torch.empty((32, 2, N, 16, 8, 128), dtype=torch.bfloat16, device=device)
    for i in range(32):
        ops.gather_blocks(kv[i], src, full[i])
    torch.cuda.synchronize()
    for name, host_wait, window, lpf in VARIANTS:
        cfg = config(window)
        sender = ChannelSender(transport(cfg, host_wait), cfg, identity)
        modes = ["pregathered", "inline-gather", "sink"]
        if "w512  lpf4" in name:
            modes.append("pregathered+busy-thread")
        for mode in modes:
            first_to_ack, walls = [], []
            for rep in range(WARM + REPS + 1):
                check = rep == WARM + REPS
                tag = "sink" if mode == "sink" else "t"
                tid = f"{tag}-{name}-{mode}-{rep}" + ("-check" if check and mode != "sink" else "")
                session = await sender.session(addrs[name], RequestId(tid.replace(" ", "_")))
                reply = await session.open([], N, time.time() + 60)
                blocks = FrameBlocks.run(reply, 0, [BlockId(s) for s in SRC])
                torch.cuda.synchronize()
                worker = None
                if mode.endswith("busy-thread"):
                    worker = threading.Thread(target=lambda: busy_times.append(busy(device)))
                    worker.start()
                t0 = time.perf_counter()
                for first in range(0, 32, lpf):
                    if mode == "inline-gather":
                        fb = torch.empty((lpf, 2, N, 16, 8, 128), dtype=torch.bfloat16, device=device)
                        for i in range(lpf):
                            ops.gather_blocks(kv[first + i], src, fb[i])
                        ev = torch.cuda.Event()
                        ev.record()
                        await event_done(ev)
                    else:
                        fb = full[first : first + lpf]
                    await session.send_layers(first, blocks, fb)
                stats = await session.complete(FirstToken(1))
                t1 = time.perf_counter()
                if worker is not None:
                    await asyncio.to_thread(worker.join)
                if WARM <= rep < WARM + REPS:
                    first_to_ack.append(stats.seconds)
                    walls.append(t1 - t0)
            med = statistics.median(walls)
            if busy_times:
                out[f"{name} busy thread during transfer ms"] = round(statistics.median(busy_times) * 1e3, 2)
                busy_times.clear()
            out[f"{name} {mode}"] = {
                "wall_ms": round(med * 1e3, 2),
                "first_send_to_ack_ms": round(statistics.median(first_to_ack) * 1e3, 2),
                "GiB/s": round(32 * N * 64 * 1024 / med / 2**30, 1),
                "all_ms": [round(w * 1e3, 1) for w in walls],
            }
            print(name, mode, out[f"{name} {mode}"], flush=True)
        if name.startswith("gpu-wait  w512"):  # the raw copy into the mapped window, connection idle
            conn = sender._connections[addrs[name]].result()
            win = conn.conn.channel._window
            assert win is not None
            out["raw copy into IPC window 256 MiB GiB/s"] = (
                frame_bytes / timed(lambda: win.narrow(0, 0, frame_bytes).copy_(a)) / 2**30
            )
        try:
            await sender.close()
        except ConnectionLost:
            pass
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    if sys.argv[1:2] == ["recv"]:
        asyncio.run(recv())
        return
    if sys.argv[1:2] == ["send"]:
        asyncio.run(send(json.loads(sys.argv[2])))
        return
    d = subprocess.Popen(
        [sys.executable, __file__, "recv"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert d.stdout is not None and d.stdin is not None
        line = d.stdout.readline()
        assert line.startswith("READY "), line
        p = subprocess.run([sys.executable, __file__, "send", line[6:]], text=True, timeout=400)
        print("sender rc", p.returncode, flush=True)
        d.stdin.close()
        print(d.stdout.read(), flush=True)
        d.wait(timeout=60)
    finally:
        if d.poll() is None:
            d.kill()


if __name__ == "__main__":
    main()
