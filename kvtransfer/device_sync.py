"""Waiting for GPU work from asyncio without blocking the event loop, and switching streams cheaply.

GPU transfers finish in tens of microseconds to a few milliseconds, so a waiter first spins (yielding to the
loop on every turn) and only then backs off to short sleeps: a blocking `synchronize()` would stall every
other transfer and HTTP request of the node, and a coarse sleep would cost a large share of the bandwidth.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator

import torch

SPIN_S = 0.002  # spin this long before sleeping
MAX_SLEEP_S = 0.001


async def poll(done: Callable[[], bool]) -> None:
    """Return once `done()` is true; `done` must be cheap (an event or work query)."""
    start = time.perf_counter()
    delay = 0.0
    while not done():
        if time.perf_counter() - start > SPIN_S:
            delay = min(max(2 * delay, 1e-4), MAX_SLEEP_S)
        await asyncio.sleep(delay)


async def event_done(event: torch.cuda.Event) -> None:
    """Return once the GPU has passed `event` (recorded by the producer of a buffer)."""
    await poll(event.query)


async def stream_idle(stream: torch.cuda.Stream) -> None:
    """Return once the work queued on `stream` so far has finished (later work is not waited for)."""
    event = torch.cuda.Event()
    event.record(stream)
    await event_done(event)


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """Make `device` current for the block; nothing to do (and nothing paid) when it is current already."""
    if device.index is None or device.index == torch.cuda.current_device():
        yield
        return
    with torch.cuda.device(device):
        yield


@contextlib.contextmanager
def on_stream(stream: torch.cuda.Stream) -> Iterator[None]:
    """Make `stream` (and its device) current for the block. When its device is current already (the usual
    case on a node), a plain set and restore: torch.cuda.device plus torch.cuda.stream took ~40 µs on the GPU
    machines' cores, in front of every payload op."""
    previous = torch.cuda.current_stream()
    if previous.device != stream.device:
        with torch.cuda.device(stream.device), torch.cuda.stream(stream):
            yield
        return
    torch.cuda.set_stream(stream)
    try:
        yield
    finally:
        torch.cuda.set_stream(previous)
