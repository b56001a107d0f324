"""What an idle ucx connection costs the process that holds it: the speed of a Python thread beside it.

A program, not a test: `python benchmarks/ucx_idle_loop.py` (CPU is enough). One process holds both ends of a
ucx connection (host memory, D's standing receive posted, nothing sent) while a Python thread runs small torch
ops, as a node's engine thread does; it reports that thread's time per step with and without the
connection, and with the loop kept turning by a task (as any spin-wait does). An event loop that turns
without pause (ucxx awaiting a request without Python futures, or a spin) takes the GIL from that thread
every few microseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time

import torch
from pdserve.kvtransfer.connector import ConnectorConfig
from pdserve.kvtransfer.framing import ByteChannel
from pdserve.kvtransfer.ucx import UcxTransport

STEPS = 20000


def engine(out: list[float]) -> None:
    x = torch.randn(64, 64)
    t0 = time.perf_counter()
    for _ in range(STEPS):
        y = x @ x
        y = y.relu() + 1
    out.append((time.perf_counter() - t0) / STEPS * 1e6)


async def measure() -> float:
    """The engine thread's µs per step while the loop idles."""
    out: list[float] = []
    thread = threading.Thread(target=engine, args=(out,))
    thread.start()
    while thread.is_alive():
        await asyncio.sleep(0.01)
    return out[0]


async def turning() -> float:
    """The engine thread's µs per step while a task keeps the loop turning (what a spin-wait does)."""
    task = asyncio.ensure_future(measure())
    while not task.done():
        await asyncio.sleep(0)
    return task.result()


async def main(reps: int) -> None:
    torch.set_num_threads(1)
    rows: dict[str, list[float]] = {
        "no connection": [],
        "no connection, loop turning without pause": [],
        "idle ucx connection": [],
    }
    for _ in range(reps):
        rows["no connection"].append(await measure())
        rows["no connection, loop turning without pause"].append(await turning())
    config = ConnectorConfig(kind="ucx", auth_token="bench", window_bytes=1 << 20)
    d_transport, p_transport = UcxTransport(config), UcxTransport(config)
    accepted: asyncio.Future[ByteChannel] = asyncio.get_running_loop().create_future()

    async def on_channel(channel: ByteChannel) -> None:
        await channel.authenticated()
        accepted.set_result(channel)

    listener = await d_transport.listen("127.0.0.1", 0, on_channel)
    p_channel = await p_transport.dial("127.0.0.1", listener.port, 5.0)
    await p_channel.authenticated()
    d_channel = await accepted  # D's standing receive is posted now
    for _ in range(reps):
        rows["idle ucx connection"].append(await measure())
    await p_channel.close()
    await d_channel.close()
    await listener.close()
    print("| process state | engine thread µs per step (median) |")
    print("|---|---|")
    for name, steps in rows.items():
        print(f"| {name} | {statistics.median(steps):.1f} |")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    asyncio.run(main(p.parse_args().reps))
