"""Waiting for GPU work from asyncio without blocking the event loop, and switching streams cheaply.

GPU transfers finish in tens of microseconds to a few milliseconds, so a waiter first spins (yielding to the
loop on every turn) and only then backs off to short sleeps: a blocking `synchronize()` would stall every
other transfer and HTTP request of the node, and a coarse sleep would cost a large share of the bandwidth.
asyncio's timers are millisecond-grained (on Linux a 0.1 ms sleep takes about 1.1 ms), so a sleeping waiter
sees its condition up to a millisecond late; a caller that learns when it is about to hold passes `wake`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator

import torch

SPIN_S = 0.002  # spin this long before sleeping
MAX_SLEEP_S = 0.001


async def poll(done: Callable[[], bool], wake: asyncio.Event | None = None) -> None:
    """Return once `done()` is true; `done` must be cheap (an event or work query). Setting `wake` ends a
    back-off sleep at once and starts a new spin: a hint to look again (done() still decides)."""
    start = time.perf_counter()
    delay = 0.0
    while not done():
        if time.perf_counter() - start > SPIN_S:
            delay = min(max(2 * delay, 1e-4), MAX_SLEEP_S)
        if delay == 0.0 or wake is None or wake.is_set():
            await asyncio.sleep(delay)
            continue
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await wake.wait()
        if wake.is_set():
            start, delay = time.perf_counter(), 0.0


async def event_done(event: torch.cuda.Event, wake: asyncio.Event | None = None) -> None:
    """Return once the GPU has passed `event` (recorded by the producer of a buffer); `wake` as in poll."""
    await poll(event.query, wake)


async def stream_idle(stream: torch.cuda.Stream) -> None:
    """Return once the work queued on `stream` so far has finished (later work is not waited for)."""
    event = torch.cuda.Event()
    event.record(stream)
    await event_done(event)


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """Make `device` current for the block; nothing to do (one C call) when it is current already."""
    if device.index is None or device.index == torch._C._cuda_getDevice():
        yield
        return
    with torch.cuda.device(device):
        yield


@contextlib.contextmanager
def on_stream(stream: torch.cuda.Stream) -> Iterator[None]:
    """Make `stream` (and its device) current for the block, then restore both. Straight through torch's C
    bindings: on a core that just woke from an idle wait (the usual state of a node's loop when a frame
    comes), torch.cuda.current_stream plus set_stream cost several times the calls beneath them, in front
    of every payload op (docs/kv_transfer_protocol.md, "Measurements")."""
    index = stream.device_index
    device = torch._C._cuda_getDevice()
    previous = torch._C._cuda_getCurrentStream(index)  # (stream id, device index, device type)
    torch._C._cuda_setStream(stream.stream_id, index, stream.device_type)  # makes `index` current too
    try:
        yield
    finally:
        torch._C._cuda_setStream(*previous)
        if device != index:
            torch._C._cuda_setDevice(device)
