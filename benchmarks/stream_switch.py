"""What a stream switch costs a node's event loop: torch's Python stream API against the C calls beneath it.

A program, not a test: `python benchmarks/stream_switch.py` on a machine with a GPU. Each case runs 300
times on an asyncio loop, either after a 2 ms idle wait ("cold": the state of a node's loop when a frame
arrives) or right after the previous one ("hot"), and prints the median and 90th percentile in µs. The
connectors switch streams in front of every payload op (kvtransfer/device_sync.py `on_stream`), so this is
time on the path of every transfer.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable

import torch
from pdserve.kvtransfer.device_sync import on_stream

REPS = 300


def cases(private: torch.cuda.Stream) -> dict[str, Callable[[], None]]:
    ids = (private.stream_id, private.device_index, private.device_type)

    def current_stream() -> None:
        torch.cuda.current_stream()

    def python_switch_and_restore() -> None:
        previous = torch.cuda.current_stream()
        torch.cuda.set_stream(private)
        torch.cuda.set_stream(previous)

    def c_switch_and_restore() -> None:
        previous = torch._C._cuda_getCurrentStream(private.device_index)
        torch._C._cuda_setStream(*ids)
        torch._C._cuda_setStream(*previous)

    def device_sync_on_stream() -> None:
        with on_stream(private):
            pass

    def wait_stream() -> None:
        private.wait_stream(torch.cuda.current_stream())

    def event_record() -> None:
        torch.cuda.Event().record()

    def nothing() -> None:
        pass

    return {
        "torch.cuda.current_stream()": current_stream,
        "torch.cuda.set_stream there and back": python_switch_and_restore,
        "torch._C stream calls there and back": c_switch_and_restore,
        "device_sync.on_stream (this commit)": device_sync_on_stream,
        "Stream.wait_stream(current)": wait_stream,
        "Event().record()": event_record,
        "nothing (timer floor)": nothing,
    }


async def measure() -> None:
    private = torch.cuda.Stream()
    print("| case | state | median µs | p90 µs |")
    print("|---|---|---:|---:|")
    for state in ("cold", "hot"):
        for name, call in cases(private).items():
            took = []
            for _ in range(REPS):
                await asyncio.sleep(0.002 if state == "cold" else 0)
                t0 = time.perf_counter()
                call()
                took.append((time.perf_counter() - t0) * 1e6)
            p90 = sorted(took)[int(0.9 * REPS)]
            print(f"| {name} | {state} | {statistics.median(took):.2f} | {p90:.2f} |")


def main() -> None:
    assert torch.cuda.is_available(), "needs a GPU"
    torch.cuda.set_device(0)
    torch.empty(1, device="cuda")  # the CUDA context exists before timing
    asyncio.run(measure())


if __name__ == "__main__":
    main()
