"""Placing one prompt: live nodes from the index, block hashes, prefix lookup, the one decision
(router/placement.py `select`), and its booking in the in-flight ledger (router/admission.py).

Invariants: the nodes come from router/membership.py's view (at most about `node_list_ttl_s` old; kept,
checked by the nodes' health, while Redis is away or comes back empty); while Redis is unreachable the
choice is load-only (no prefix hits), as DESIGN.md's failure model asks. A node whose circuit breaker is open
(router/breaker.py: its connection was refused or reset) gets no request, and none goes to a node whose model
or tokenizer is not the router's (router/model_check.py).
Block size, model fingerprint and context limit (max_model_len) come from the nodes' registrations (the
index refuses nodes that disagree), never from the router's own config, which nothing here rewrites.
Refusals are domain errors (router/errors.py); the request handler maps them to OpenAI errors. What was
decided is emitted to the telemetry sink (router/telemetry.py), never counted here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.router.admission import Booking, InFlight, NodeFull, Turn
from pdserve.router.background import Background
from pdserve.router.breaker import Breakers
from pdserve.router.cost_model import CostModel, Estimate, Inputs
from pdserve.router.errors import NoNodes
from pdserve.router.membership import Membership
from pdserve.router.metrics import RouterMetrics
from pdserve.router.model_check import ModelCheck
from pdserve.router.placement import Selection, select
from pdserve.router.policy import NodeView, NoNodeAvailable, PolicyConfig
from pdserve.router.telemetry import (
    Decided,
    Event,
    PrefixHits,
    Telemetry,
    cost_learner,
    log_events,
    metrics_subscriber,
)
from pdserve.shared.engine.block_hash import hash_blocks, hash_seed
from pdserve.shared.index.block_index import BlockIndex
from pdserve.shared.index.block_index_types import IndexUnavailable, NodeInfo, NodeStatus
from pdserve.shared.types import NodeId

_RATES_EVERY_S = 5.0
"""How often the router publishes its cost model's learned rates to the index (for kvctl where)."""
_REFUSAL_REFRESH_S = 0.1
"""A refusal re-reads the node list when it is older than this, before the request is placed again."""


@dataclass(frozen=True)
class Route:
    """Where one prompt runs: decode (or single) node, and the prefill node when disaggregated."""

    kind: str
    decode: NodeInfo
    prefill: NodeInfo | None
    indexed_blocks: int = 0
    """Leading prompt blocks the index said the prefilling node holds when the route was chosen."""
    fetch_from: NodeInfo | None = None
    """A node the index said holds `fetch_blocks` leading prompt blocks (more than the prefilling node):
    the prefilling node (P, or D when it prefills: local_fetch) fetches them from it
    (node/kv_fetch.py) instead of computing them."""
    fetch_blocks: int = 0
    estimate: Estimate | None = None
    """The cost model's estimate for the option this route takes, and its inputs (for what it learns)."""
    inputs: Inputs | None = None

    @property
    def prefilling(self) -> NodeInfo:
        return self.decode if self.prefill is None else self.prefill

    def expected_cached_tokens(self, prompt_len: int) -> int:
        """Prompt tokens the prefilling node should find cached if the index was right (an engine computes at
        least the prompt's last token, so a block holding it is never a hit)."""
        size = self.decode.block_size
        return min(self.indexed_blocks, (prompt_len - 1) // size) * size

    def planned_fetch_tokens(self, prompt_len: int) -> int:
        """Prompt tokens the prefilling node should fetch if the index was right (beyond its own hits)."""
        if self.fetch_from is None:
            return 0
        usable = min(self.fetch_blocks, (prompt_len - 1) // self.decode.block_size) * self.decode.block_size
        return max(0, usable - self.expected_cached_tokens(prompt_len))


@dataclass(frozen=True)
class Placement:
    """A routed prompt: its route, the context limit of the nodes it uses, the block-size fingerprint, and
    one booking in the in-flight ledger per choice (router/admission.py), which the choice gives back when
    it ends."""

    route: Route
    max_model_len: int
    model_fingerprint: str
    bookings: tuple[Booking, ...]

    def release(self) -> None:
        for booking in self.bookings:
            booking.release()


@dataclass(eq=False)
class Router:
    """The router's view of the cluster, shared by all requests of one process."""

    _index: BlockIndex
    _policy: PolicyConfig
    _membership: Membership
    _metrics: RouterMetrics
    _background: Background
    _breakers: Breakers
    _ledger: InFlight
    _model_check: ModelCheck
    cost: CostModel = field(default_factory=CostModel)
    """Learns from every placed request (through `telemetry`); picks the prefill option if `cost_decides`."""
    cost_decides: bool = False
    telemetry: Telemetry = field(default_factory=Telemetry, init=False)
    """Where placement and dispatch report what happened (router/telemetry.py). Subscribed: the metrics,
    the cost model's learning, the debug log, and this router's writes to the index (hit statistics for
    kvctl stats, the cost model's rates for kvctl where)."""
    _rates_due: float = field(default=0.0, init=False)
    _rotation: int = field(default=0, init=False)
    _refused: dict[NodeId, tuple[float, int]] = field(default_factory=dict, init=False)
    """Nodes that refused new work (draining, or no longer of the role the view gave them) -> (monotonic time
    until which no request goes there, the epoch that refused: a node registered again since, e.g. under its
    new role, is not avoided)."""

    def __post_init__(self) -> None:
        if self.cost_decides:  # the policy picks the pair; the cost model picks local or P/D (placement.py)
            self._policy = dataclasses.replace(self._policy, local_prefill_max_tokens=0)
        for subscriber in (metrics_subscriber(self._metrics), cost_learner(self.cost), log_events):
            self.telemetry.subscribe(subscriber)
        self.telemetry.subscribe(self._on_event)

    @property
    def index_ok(self) -> bool:
        """Whether the last call to Redis succeeded."""
        return self._membership.index_ok

    async def nodes(self) -> list[NodeStatus]:
        """The nodes that may get new work (router/membership.py's view, breakers closed, not draining)."""
        now = time.monotonic()
        return [s for s in await self._membership.nodes() if self.usable(s, now)]

    async def holders(self) -> list[NodeStatus]:
        """The nodes a prefix may be fetched from: the usable ones and the draining ones (a draining node
        serves exports until it leaves; a drain with --migrate pins its moved requests' KV for that fetch)."""
        return [s for s in await self._membership.nodes() if not self._breakers.is_open(s.info.node_id)]

    async def refused(self, node_id: NodeId) -> None:
        """A node turned a request away before starting it (it is draining, or changed role since the view
        was read): route around that registration at once and read the node list again (unless it is under
        `_REFUSAL_REFRESH_S` old), so the placement that follows sees the nodes' roles and drains as they are
        now, not as they were up to a TTL ago (several nodes changing role at once would otherwise refuse
        every reroute in turn)."""
        epochs = {s.info.node_id: s.info.epoch for s in await self._membership.nodes()}
        self._refused[node_id] = (time.monotonic() + 5.0, epochs.get(node_id, -1))
        with contextlib.suppress(Exception):  # logged by the membership; the reroute uses the view it has
            await self._membership.refresh(max_age_s=_REFUSAL_REFRESH_S)

    async def place(
        self, prompt: Sequence[int], cache_salt: str | None, deadline: float, n: int = 1
    ) -> Placement:
        """Route one prompt for n choices. NoNodes when no node can take it, ModelMismatch when the chosen
        nodes serve another model; while every node of a role it needs is at its in-flight limit it waits
        for room (QueueFull past the admission queue, NoRoom at the deadline)."""
        started = time.perf_counter()
        known = await self.nodes()
        if not known:
            raise NoNodes("no serving node is available")
        holders = await self.holders()
        first = known[0].info
        block_size = first.block_size
        hashes = hash_blocks(
            prompt, block_size, hash_seed(bytes.fromhex(first.model_fingerprint), cache_salt)
        )
        hits: dict[NodeId, int] = {}
        if self.index_ok:
            try:
                hits = await self._index.lookup(hashes)
            except IndexUnavailable:
                self._membership.index_failed()
        # From the room check to the bookings nothing else awaits with the local ledger, so a burst cannot
        # pass the check all at once; the fleet's ledger checks the cap (and whose turn it is) again in
        # Redis as it books, and a refusal (NodeFull) sends the placement back to wait and to the room
        # check. Time spent waiting for room is not routing time.
        first_wait = time.perf_counter()
        with self._ledger.turn() as turn:
            while True:
                waited = time.perf_counter()
                statuses = await self._with_room(deadline, turn)
                started += time.perf_counter() - waited
                selection, live = self._select(len(prompt), block_size, hits, statuses, holders)
                want = (selection.decode, selection.prefill, selection.estimate.compute_tokens, n, turn)
                try:
                    bookings = await self._ledger.acquire(*want)
                except NodeFull:  # filled by another router, or it is an earlier placement's turn
                    self._metrics.admission_waits.inc()
                    await self._ledger.wait_for_room(deadline, turn)
                    continue
                break
        room = time.perf_counter()  # the admission wait: from first_wait to here, less the routing itself
        decode = live[selection.decode]
        prefill = None if selection.prefill is None else live[selection.prefill]
        fetch_from = None if selection.fetch_from is None else live[selection.fetch_from]
        route = Route(selection.kind, decode, prefill, selection.cached_blocks, fetch_from,
                      selection.fetch_blocks, selection.estimate, selection.inputs)  # fmt: skip
        self.telemetry.emit(Decided(selection, time.perf_counter() - started, (first_wait, room)))
        max_len = min(node.max_model_len for node in (decode, prefill) if node is not None)
        return Placement(route, max_len, first.model_fingerprint, bookings)

    def _select(
        self,
        prompt_tokens: int,
        block_size: int,
        hits: dict[NodeId, int],
        statuses: list[NodeStatus],
        holders: list[NodeStatus],
    ) -> tuple[Selection, dict[NodeId, NodeInfo]]:
        """The one decision over the nodes with room (NoNodes when none fits, ModelMismatch when the chosen
        nodes serve another model), and the registrations by id of the nodes it may name (`holders`: those
        a prefix may be fetched from, the chosen pair among them)."""
        if not statuses:
            raise NoNodes("no serving node is available")
        self._rotation += 1
        ledger = self._ledger
        try:
            selection = select(
                prompt_tokens, block_size, hits, [ledger.view(NodeView.from_status(s)) for s in statuses],
                {s.info.node_id for s in holders}, self._policy, self.cost, self.cost_decides,
                lambda node_id: ledger.load(node_id).prefill_tokens, self._rotation,
            )  # fmt: skip
        except NoNodeAvailable as exc:
            raise NoNodes(str(exc)) from exc
        live = {s.info.node_id: s.info for s in holders}
        for node_id in (selection.decode, selection.prefill):
            if node_id is not None:
                self._model_check.check(live[node_id])  # ModelMismatch: the router's model is not theirs
        return selection, live

    async def _with_room(self, deadline: float, turn: Turn) -> list[NodeStatus]:
        """The usable nodes below their in-flight limit, once every role among the usable nodes has one."""
        while True:
            statuses = await self.nodes()
            room = [s for s in statuses if not self._ledger.full(s.info.node_id)]
            if {s.info.role for s in room} == {s.info.role for s in statuses}:
                return room
            self._metrics.admission_waits.inc()
            await self._ledger.wait_for_room(deadline, turn)

    def usable(self, status: NodeStatus, now: float) -> bool:
        """Whether a live node may get new work: not draining, not refusing, its breaker closed."""
        node_id = status.info.node_id
        until, epoch = self._refused.get(node_id, (0.0, -1))
        refused = until >= now and epoch in (status.info.epoch, -1)
        return not (status.draining or refused or self._breakers.is_open(node_id))

    def _on_event(self, event: Event) -> None:
        """The index's hit statistics (kvctl stats) from what the prefilling nodes reported, and the cost
        model's rates (kvctl where) at most every _RATES_EVERY_S, both written in the background."""
        if not self.index_ok:
            return
        if isinstance(event, PrefixHits):
            self._background.spawn(self._record_hits(event))
        elif isinstance(event, Decided) and time.monotonic() >= self._rates_due:
            self._rates_due = time.monotonic() + _RATES_EVERY_S
            self._background.spawn(self._publish_rates())

    async def _publish_rates(self) -> None:
        try:
            await self._index.set_cost_rates(self.cost.rates.to_json())
        except IndexUnavailable:
            self._membership.index_failed()

    async def _record_hits(self, hits: PrefixHits) -> None:
        try:
            await self._index.record_hits(hits.node_id, hits.local, hits.remote, hits.miss)
        except IndexUnavailable:
            self._membership.index_failed()
