"""The tensor-parallel engine's per-step broadcast at batch 1, in microseconds, beside torch.distributed's
gloo broadcast of the same packed message as its peer.

A program, not a test: `python benchmarks/tp_step_broadcast.py [--context 1024] [--iters 2000]` starts one
worker process and, per iteration, sends a batch-1 decode step (one token, the block table of a `--context`
token sequence) and waits for the worker's one-byte acknowledgement once it holds the unpacked batch:
- `shared memory + doorbell` is the engine's channel (shared/engine/parallel/step_channel.py): rank 0's cost
  is `publish` (pack, copy into the region, ring the doorbell); the worker's is waking and unpacking;
- `gloo broadcast` sends the same int32 message as a tensor of a fixed capacity (a receiver must know the
  size beforehand) of the engine's default shape (64 sequences, 2,048 tokens, 8k context), then unpacks.
Round trips include the acknowledgement's own trip back (a pipe byte), so one-way is about half of one.
The machine's load falls on the result: run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from pdserve.shared.engine.model_runner import BatchItem
from pdserve.shared.engine.parallel.step_channel import StepReader, StepWriter, capacity_bytes, pack, unpack

CAPACITY = capacity_bytes(64, 2048, 8192 // 16)


def _item(context: int) -> list[BatchItem]:
    blocks = list(range(-(-(context + 1) // 16)))
    return [BatchItem(list(range(context + 1)), context, 1, blocks, True)]


def worker(args: dict[str, int]) -> None:
    ack = args["ack_fd"]
    if args["mode"] == 0:
        reader = StepReader(args["region_fd"], args["bell_fd"], CAPACITY, 0, 1)
        while reader.receive() is not None:
            os.write(ack, b"\x01")
        return
    store = dist.TCPStore("127.0.0.1", args["port"], is_master=False)
    dist.init_process_group("gloo", store=store, rank=1, world_size=2)
    buf = torch.empty(CAPACITY // 4, dtype=torch.int32)
    for _ in range(args["iters"]):
        dist.broadcast(buf, src=0)
        unpack(buf.numpy().tobytes()[: 4 * (4 + 5 + int(buf[2]) + int(buf[3]))])
        os.write(ack, b"\x01")
    dist.destroy_process_group()


def _timed(iters: int, publish: Callable[[], None], ack_r: int) -> tuple[list[float], list[float]]:
    """(publish, round trip) in microseconds of each of `iters` steps; the worker acks each on `ack_r`."""
    published, rtt = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        publish()
        t1 = time.perf_counter()
        os.read(ack_r, 1)
        t2 = time.perf_counter()
        published.append((t1 - t0) * 1e6)
        rtt.append((t2 - t0) * 1e6)
    return published, rtt


def bench_shm(items: list[BatchItem], iters: int) -> tuple[list[float], list[float]]:
    writer = StepWriter(CAPACITY, 1)
    ack_r, ack_w = os.pipe()
    region_fd, bell_fd = writer.fds(0)
    args = {"mode": 0, "region_fd": region_fd, "bell_fd": bell_fd, "ack_fd": ack_w}
    proc = subprocess.Popen(
        [sys.executable, __file__, "--worker", json.dumps(args)], pass_fds=(region_fd, bell_fd, ack_w)
    )
    writer.started()
    os.close(ack_w)
    times = _timed(iters, lambda: writer.publish(items, False), ack_r)
    writer.close()
    proc.wait()
    return times


def bench_gloo(items: list[BatchItem], iters: int) -> tuple[list[float], list[float]]:
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    ack_r, ack_w = os.pipe()
    args = {"mode": 1, "port": store.port, "ack_fd": ack_w, "iters": iters}
    proc = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(args)], pass_fds=(ack_w,))
    os.close(ack_w)
    dist.init_process_group("gloo", store=store, rank=0, world_size=2)
    buf = torch.zeros(CAPACITY // 4, dtype=torch.int32)

    def publish() -> None:
        msg = pack(items)
        buf[: len(msg)] = torch.frombuffer(msg, dtype=torch.int32)
        dist.broadcast(buf, src=0)

    times = _timed(iters, publish, ack_r)
    dist.destroy_process_group()
    proc.wait()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        worker(json.loads(opts.worker))
        return
    items = _item(opts.context)
    size = len(pack(items)) * 4
    print(f"# batch-1 step broadcast, {opts.context}-token context ({size} B message), "
          f"{opts.iters} iterations, {datetime.date.today()}, {os.cpu_count()} CPUs")  # fmt: skip
    print("| channel | rank 0's send, median µs | round trip, median µs | round trip, p90 µs |")
    print("|---|---|---|---|")
    for name, fn in (("shared memory + doorbell", bench_shm), (f"gloo broadcast ({CAPACITY} B)", bench_gloo)):
        publish, rtt = fn(items, opts.iters)
        p90 = statistics.quantiles(rtt, n=10)[-1]
        print(f"| {name} | {statistics.median(publish):.1f} | {statistics.median(rtt):.1f} | {p90:.1f} |")


if __name__ == "__main__":
    main()
