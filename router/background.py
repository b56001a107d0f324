"""Fire-and-forget tasks of the router (aborts sent to nodes, hit counters written to the index).

Invariants: a spawned task is referenced until it ends, so it outlives the request that spawned it even when
that request is cancelled; `drain()` at shutdown waits for every one of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class Background:
    """Tasks that must outlive a cancelled request; kept referenced until done."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
