"""Circuit breakers on the router's nodes: a node whose connection is refused or reset leaves routing at once,
not after its heartbeat expires in the index, and a probe of its /internal/health brings it back.

Invariants: a breaker opens on a transport failure only (connection refused or timed out, connection reset,
a stream cut before its end: router/node_client.py decides), never on an HTTP status (a node that answers is
up; a draining node's 503 has its own path) nor on a read timeout (that is the request's deadline). While a
breaker is open exactly one probe task runs for its node, probing with backoff from `probe_initial_s` up to
`probe_max_s`; the breaker closes when the node answers its health as itself. `forget` closes the breaker of
a node that left the cluster and cancels its probe; `aclose` cancels every probe. Pure asyncio: the probe is a
callable, so this module makes no HTTP call itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pdserve.router.metrics import RouterMetrics
from pdserve.shared.types import NodeId

log = logging.getLogger(__name__)

Probe = Callable[[NodeId, str], Awaitable[bool]]
"""(node id, http url) -> whether the node at that URL answered its health as that node."""


@dataclass(frozen=True)
class BreakerConfig:
    probe_initial_s: float = 0.25
    """First probe this long after the breaker opened; each failed probe doubles the wait."""
    probe_max_s: float = 5.0
    """Longest wait between two probes of a node that stays down."""

    def __post_init__(self) -> None:
        if not 0 < self.probe_initial_s <= self.probe_max_s:
            raise ValueError(
                f"need 0 < probe_initial_s ({self.probe_initial_s}) <= probe_max_s ({self.probe_max_s})"
            )


@dataclass
class _Open:
    url: str
    since: float
    reason: str
    probe: asyncio.Task[None] | None = None


class Breakers:
    """The breakers of one router process, keyed by node id."""

    def __init__(self, config: BreakerConfig, probe: Probe, metrics: RouterMetrics) -> None:
        self._config = config
        self._probe = probe
        self._metrics = metrics
        self._open: dict[NodeId, _Open] = {}

    def is_open(self, node_id: NodeId) -> bool:
        """Whether no request may go to the node now."""
        return node_id in self._open

    def open_nodes(self) -> list[NodeId]:
        return sorted(self._open)

    def trip(self, node_id: NodeId, url: str, reason: str) -> None:
        """A call to the node failed at the transport level: open its breaker (no-op if already open)."""
        if node_id in self._open:
            return
        state = _Open(url, time.monotonic(), reason)
        self._open[node_id] = state
        self._metrics.circuit_open.labels(node_id=node_id).set(1)
        self._metrics.circuit_trips.labels(node_id=node_id).inc()
        log.warning("node %s at %s is down (%s): no request goes there until it answers", node_id, url,
                    reason)  # fmt: skip
        with contextlib.suppress(RuntimeError):  # no running loop: probing starts with the next trip
            state.probe = asyncio.get_running_loop().create_task(self._probe_until_up(node_id, state))

    def forget(self, node_id: NodeId) -> None:
        """The node left the cluster: drop its breaker and stop probing it."""
        state = self._open.pop(node_id, None)
        if state is None:
            return
        if state.probe is not None:
            state.probe.cancel()
        self._metrics.circuit_open.labels(node_id=node_id).set(0)

    async def aclose(self) -> None:
        tasks = [s.probe for s in self._open.values() if s.probe is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _probe_until_up(self, node_id: NodeId, state: _Open) -> None:
        wait = self._config.probe_initial_s
        while True:
            await asyncio.sleep(wait)
            if await self._probe(node_id, state.url):
                break
            wait = min(wait * 2, self._config.probe_max_s)
        if self._open.get(node_id) is state:
            del self._open[node_id]
            self._metrics.circuit_open.labels(node_id=node_id).set(0)
            down_s = time.monotonic() - state.since
            log.info("node %s answers again after %.1fs: back in routing", node_id, down_s)
