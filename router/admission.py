"""The router's own count of the work it placed on each node, and the admission gate in front of placement.

Heartbeat loads are up to a second old, so a burst placed within that second would see one snapshot and herd
onto one node. Each placement therefore takes a `Lease` at once: one request and its prompt tokens on the
prefilling node (given back when that node's part ends) and one request on the decoding node (given back
when the choice ends on any path). The policy sees, per node, the larger of the heartbeat's figure and this
router's count.

Admission: with `AdmissionConfig.max_requests_per_node` set, a node holding that many of this router's
requests takes no more. A request that finds every node of a needed role at the limit waits, first come
first served, for a lease to end; at most `max_queued` requests wait, and none past its deadline. Beyond the
queue it is refused with 429 and Retry-After before anything was sent to a node or streamed to the client:
an admitted request never fails for load.

Invariants: a Lease gives back exactly what it took, once (`release` is idempotent, and `prefill_done` gives
back the prefill part once); counts never go negative; waiters are woken in arrival order, one per lease
that ends.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field, replace

from pdserve.router.errors import NoRoom, QueueFull
from pdserve.router.policy import NodeView
from pdserve.shared.types import NodeId


@dataclass(frozen=True)
class AdmissionConfig:
    max_requests_per_node: int = 0
    """Requests this router keeps in flight on one node at most (0: no limit, nothing ever waits)."""
    max_queued: int = 1024
    """Requests that may wait for room at once; beyond it the router answers 429."""
    retry_after_s: int = 1
    """The Retry-After a refused client gets."""

    def __post_init__(self) -> None:
        if self.max_requests_per_node < 0 or self.max_queued < 0 or self.retry_after_s < 1:
            raise ValueError(f"admission limits must be >= 0 (retry_after_s >= 1), got {self}")


@dataclass
class _Count:
    requests: int = 0
    prefill_tokens: int = 0


@dataclass(eq=False)
class Lease:
    """What one choice holds on its nodes until it ends: one request on each of `nodes`, and one request and
    `tokens` prompt tokens on `prefill` until its part ends."""

    _ledger: Ledger
    _nodes: tuple[NodeId, ...]
    _prefill: NodeId | None
    _tokens: int
    _live: bool = field(default=True, init=False)

    def prefill_done(self) -> None:
        """The prefilling node's part is over: neither its request nor its tokens are this choice's."""
        if self._prefill is not None:
            prefill, self._prefill = self._prefill, None
            self._ledger._add_tokens(prefill, -self._tokens)
            self._ledger._end((prefill,))

    def release(self) -> None:
        if self._live:
            self._live = False
            self.prefill_done()
            self._ledger._end(self._nodes)


class Ledger:
    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self._counts: dict[NodeId, _Count] = {}
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def requests(self, node_id: NodeId) -> int:
        count = self._counts.get(node_id)
        return 0 if count is None else count.requests

    def view(self, node: NodeView) -> NodeView:
        """The node as the policy should see it: the heartbeat's load, or this router's own if larger."""
        count = self._counts.get(node.node_id)
        if count is None:
            return node
        waiting = max(node.waiting, count.requests - node.running)
        return replace(
            node, waiting=waiting, queued_prefill_tokens=max(node.queued_prefill_tokens, count.prefill_tokens)
        )

    def full(self, node_id: NodeId) -> bool:
        limit = self.config.max_requests_per_node
        return limit > 0 and self.requests(node_id) >= limit

    def take(self, nodes: tuple[NodeId, ...], prefill: NodeId | None, prompt_tokens: int) -> Lease:
        """A lease of one request on each of `nodes` (the decoding node) and, on `prefill`, one request and
        `prompt_tokens` until its part ends."""
        for node_id in (*nodes, *((prefill,) if prefill is not None else ())):
            self._counts.setdefault(node_id, _Count()).requests += 1
        if prefill is not None:
            self._add_tokens(prefill, prompt_tokens)
        return Lease(self, nodes, prefill, prompt_tokens)

    async def wait_for_room(self, deadline: float) -> None:
        """Waits for some lease to end; QueueFull when the queue is full, NoRoom at the deadline."""
        if len(self._waiters) >= self.config.max_queued:
            raise QueueFull(
                f"every node is at its limit of {self.config.max_requests_per_node} requests and "
                f"{len(self._waiters)} requests are waiting; retry later",
                self.config.retry_after_s,
            )
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(max(0.0, deadline - time.time())):
                await waiter
        except TimeoutError:
            raise NoRoom(
                "no node had room before the request's deadline", self.config.retry_after_s
            ) from None
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def _add_tokens(self, node_id: NodeId, tokens: int) -> None:
        count = self._counts.setdefault(node_id, _Count())
        count.prefill_tokens += tokens
        self._forget_if_idle(node_id, count)

    def _end(self, nodes: tuple[NodeId, ...]) -> None:
        for node_id in nodes:
            count = self._counts[node_id]
            count.requests -= 1
            self._forget_if_idle(node_id, count)
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                break

    def _forget_if_idle(self, node_id: NodeId, count: _Count) -> None:
        assert count.requests >= 0 and count.prefill_tokens >= 0, f"{node_id}: negative in-flight count"
        if not count.requests and not count.prefill_tokens:
            del self._counts[node_id]
