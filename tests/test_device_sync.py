"""kvtransfer/device_sync.poll: a waiter past its spin sleeps in asyncio's timer (millisecond-grained: on
Linux a 0.1 ms sleep takes about 1.1 ms), so a condition that turns true meanwhile is seen up to a sleep late.
A caller that learns the moment its condition turns true (the prefill node: its first token is on the host,
so the GPU has passed every gather queued before it) passes `wake`, which ends the sleep at once.
"""

from __future__ import annotations

import asyncio

import pytest
from pdserve.kvtransfer import device_sync


def test_poll_rechecks_at_once_when_woken(monkeypatch: pytest.MonkeyPatch) -> None:
    # no spin and a minute-long back-off: only the wake can end the wait before the guard below
    monkeypatch.setattr(device_sync, "SPIN_S", 0.0)
    monkeypatch.setattr(device_sync, "MAX_SLEEP_S", 60.0)
    ready = False
    checks = 0

    def done() -> bool:
        nonlocal checks
        checks += 1
        return ready

    async def scenario() -> None:
        nonlocal ready
        wake = asyncio.Event()
        waiter = asyncio.ensure_future(device_sync.poll(done, wake))
        for _ in range(3):  # the waiter checked, found nothing, and went to sleep
            await asyncio.sleep(0)
        assert not waiter.done() and checks >= 1
        ready = True
        wake.set()
        async with asyncio.timeout(30):  # a hang guard: without the wake it sleeps 60 s
            await waiter

    asyncio.run(scenario())


def test_poll_keeps_waiting_when_woken_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wake is a hint to look again, not the condition: poll returns only once done() holds."""
    monkeypatch.setattr(device_sync, "SPIN_S", 0.0)
    monkeypatch.setattr(device_sync, "MAX_SLEEP_S", 0.001)
    checks = 0

    def done() -> bool:
        nonlocal checks
        checks += 1
        return checks > 50

    async def scenario() -> None:
        wake = asyncio.Event()
        wake.set()
        async with asyncio.timeout(30):
            await device_sync.poll(done, wake)

    asyncio.run(scenario())
    assert checks == 51
