"""Choosing nodes for one prompt: live nodes from the index, block hashes, prefix lookup, policy.choose.

Invariants: the nodes come from router/membership.py's view (at most about `node_list_ttl_s` old; kept,
checked by the nodes' health, while Redis is away or comes back empty); while Redis is unreachable the
choice is load-only (no prefix hits), as DESIGN.md's failure model asks. A node whose circuit breaker is open
(router/breaker.py: its connection was refused or reset) gets no request, and none goes to a node whose model
or tokenizer is not the router's (router/model_check.py).
Block size, model fingerprint and context limit (max_model_len) come from the nodes' registrations (the
index refuses nodes that disagree), never from the router's own config, which nothing here rewrites.
Refusals are domain errors (router/errors.py); the request handler maps them to OpenAI errors.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.router.admission import Lease, Ledger
from pdserve.router.background import Background
from pdserve.router.breaker import Breakers
from pdserve.router.cost_model import CostModel, Estimate, Inputs, Option
from pdserve.router.errors import NoNodes
from pdserve.router.membership import Membership
from pdserve.router.metrics import RouterMetrics
from pdserve.router.model_check import ModelCheck
from pdserve.router.policy import NodeView, NoNodeAvailable, PolicyConfig, choose
from pdserve.shared.engine.block_hash import hash_blocks, hash_seed
from pdserve.shared.index.block_index import BlockIndex
from pdserve.shared.index.block_index_types import IndexUnavailable, NodeInfo, NodeStatus
from pdserve.shared.types import NodeId

_KIND = {"disaggregated": "pd", "local_prefill": "local", "single": "single"}
_RATES_EVERY_S = 5.0
"""How often the router publishes its cost model's learned rates to the index (for kvctl where)."""


@dataclass(eq=False)
class PrefillHold:
    """A routed prompt's tokens still to compute on its prefilling node (P, or D prefilling it itself), in
    this router's own count, from the choice to its first token or its end. They are the cost model's queue
    depths: fresher than the nodes' heartbeats (one a second), whose stale queues made its estimates err."""

    _counts: dict[NodeId, int]
    node: NodeId
    tokens: int
    _held: bool = True

    def release(self) -> None:
        """Idempotent."""
        if self._held:
            self._held = False
            left = self._counts[self.node] - self.tokens
            if left:
                self._counts[self.node] = left
            else:
                del self._counts[self.node]


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
    (shared/node/kv_fetch.py) instead of computing them."""
    fetch_blocks: int = 0
    estimate: Estimate | None = None
    """The cost model's estimate for the option this route takes, and its inputs (for what it learns)."""
    inputs: Inputs | None = None
    hold: PrefillHold | None = None
    """Released by dispatch at the choice's first token (and at its end)."""

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
    one lease on the nodes per choice (router/admission.py), which the choice gives back when it ends."""

    route: Route
    max_model_len: int
    model_fingerprint: str
    leases: tuple[Lease, ...]

    def release(self) -> None:
        for lease in self.leases:
            lease.release()
        if self.route.hold is not None:
            self.route.hold.release()


@dataclass(eq=False)
class Router:
    """The router's view of the cluster, shared by all requests of one process."""

    _index: BlockIndex
    _policy: PolicyConfig
    _membership: Membership
    _metrics: RouterMetrics
    _background: Background
    _breakers: Breakers
    _ledger: Ledger
    _model_check: ModelCheck
    cost: CostModel = field(default_factory=CostModel)
    """Learns from every placed request; picks the prefill option only when `cost_decides`."""
    cost_decides: bool = False
    _rates_due: float = field(default=0.0, init=False)
    _prefilling: dict[NodeId, int] = field(default_factory=dict, init=False)
    """Tokens routed to each node and not computed yet (PrefillHold), by this router."""
    _rotation: int = field(default=0, init=False)
    _refused: dict[NodeId, float] = field(default_factory=dict, init=False)
    """Nodes that refused new work (draining) -> monotonic time until which no request goes there."""

    @property
    def index_ok(self) -> bool:
        """Whether the last call to Redis succeeded."""
        return self._membership.index_ok

    async def nodes(self) -> list[NodeStatus]:
        """The nodes that may get new work (router/membership.py's view, breakers closed, not draining)."""
        now = time.monotonic()
        return [s for s in await self._membership.nodes() if self.usable(s, now)]

    def fetched(self, node_id: NodeId, remote_tokens: int, miss_tokens: int) -> None:
        """What a prefill node reported it fetched (and what a planned fetch left it to compute), for the
        index's hit statistics (kvctl stats), beside the local and miss counts routing recorded."""
        if self.index_ok:
            self._background.spawn(self._record_hits(node_id, 0, remote_tokens, miss_tokens))

    def refused(self, node_id: NodeId) -> None:
        """A node turned a request away before starting it (it is draining): route around it at once,
        without waiting for the cached node list to expire; the index shows the drain within a TTL."""
        self._refused[node_id] = time.monotonic() + 5.0

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
        # From the room check to the leases nothing awaits (no suspension while there is room), so a burst
        # cannot pass the check all at once; time spent waiting for room is not routing time.
        waited = time.perf_counter()
        statuses = await self._with_room(deadline)
        started += time.perf_counter() - waited
        if not statuses:
            raise NoNodes("no serving node is available")
        self._rotation += 1
        views = {s.info.node_id: self._ledger.view(NodeView.from_status(s)) for s in statuses}
        policy = self._policy
        if self.cost_decides:  # the policy picks the pair; the cost model picks local or P/D below
            policy = dataclasses.replace(policy, local_prefill_max_tokens=0)
        try:
            decision = choose(
                len(hashes), len(prompt), hits, list(views.values()), policy, self._rotation,
                block_size=block_size,
            )  # fmt: skip
        except NoNodeAvailable as exc:
            raise NoNodes(str(exc)) from exc
        by_id = {s.info.node_id: s.info for s in statuses}
        decode = by_id[decision.decode]
        prefill = by_id[decision.prefill] if decision.mode == "disaggregated" else None
        holder, fetch_blocks = _holder(hits, known, prefill, decision.cached_blocks_prefill)
        # a holder for the decode node itself, when the cost model may let it prefill (local_fetch)
        holder_d, blocks_d = None, 0
        if self.cost_decides and prefill is not None:
            holder_d, blocks_d = _holder(hits, known, decode, decision.cached_blocks_decode)
        own = self._prefilling
        inputs = Inputs(
            len(prompt), block_size, decision.cached_blocks_prefill, decision.cached_blocks_decode,
            fetch_blocks, own.get(decision.prefill, 0), own.get(decision.decode, 0), prefill is not None,
            blocks_d,
        )  # fmt: skip
        options = {e.option: e for e in self.cost.estimates(inputs)}
        if self.cost_decides and prefill is not None:
            best = self.cost.choose(inputs)
            if best.option in ("local", "local_fetch"):
                decision = dataclasses.replace(
                    decision, mode="local_prefill", prefill=decision.decode, blocks_to_transfer=0,
                    cached_blocks_prefill=decision.cached_blocks_decode,
                    tokens_to_compute=best.compute_tokens,
                )  # fmt: skip
                prefill = None
            if best.option == "local_fetch":
                holder, fetch_blocks = holder_d, blocks_d
            elif best.option != "pd_fetch":
                holder, fetch_blocks = None, 0
        option: Option
        if prefill is None:
            option = "local_fetch" if holder is not None else "local"
        else:
            option = "pd_fetch" if holder is not None else "pd"
        estimate = options[option]
        nodes = [node for node in (decode, prefill) if node is not None]
        for node in nodes:
            self._model_check.check(node)  # ModelMismatch: the router's model is not theirs
        self._metrics.routing.observe(time.perf_counter() - started)
        kind = _KIND[decision.mode]
        m = self._metrics
        m.decisions.labels(kind=kind).inc()
        m.decision_score.labels(kind=kind, node_id=decision.prefill).observe(decision.score)
        m.decision_prefill_tokens.labels(kind=kind, node_id=decision.prefill).observe(
            decision.tokens_to_compute
        )
        local = decision.cached_blocks_prefill * block_size
        m.cost_decisions.labels(option=option).inc()
        m.cost_estimated_ttft.labels(option=option).observe(estimate.ttft_s)
        prefilling = decode.node_id if prefill is None else prefill.node_id
        tokens = estimate.compute_tokens * n
        own[prefilling] = own.get(prefilling, 0) + tokens
        hold = PrefillHold(own, prefilling, tokens)
        route = Route(
            kind,
            decode,
            prefill,
            decision.cached_blocks_prefill,
            holder,
            fetch_blocks,
            estimate,
            inputs,
            hold,
        )
        # what a fetch brings is counted when the prefill node says what came (dispatch: remote, or miss)
        miss = len(prompt) - local - route.planned_fetch_tokens(len(prompt))
        m.prefix_hit_tokens.labels(kind="local").inc(local)
        m.prefix_hit_tokens.labels(kind="miss").inc(miss)
        if self.index_ok:
            self._background.spawn(self._record_hits(decision.prefill, local, 0, miss))
            if time.monotonic() >= self._rates_due:  # what kvctl where estimates with
                self._rates_due = time.monotonic() + _RATES_EVERY_S
                self._background.spawn(self._publish_rates())
        owner = None if prefill is None else prefill.node_id
        leases = tuple(self._ledger.take((decode.node_id,), owner, len(prompt)) for _ in range(n))
        return Placement(
            route,
            min(node.max_model_len for node in nodes),
            first.model_fingerprint,
            leases,
        )

    async def _with_room(self, deadline: float) -> list[NodeStatus]:
        """The usable nodes below their in-flight limit, once every role among the usable nodes has one."""
        while True:
            statuses = await self.nodes()
            room = [s for s in statuses if not self._ledger.full(s.info.node_id)]
            if {s.info.role for s in room} == {s.info.role for s in statuses}:
                return room
            self._metrics.admission_waits.inc()
            await self._ledger.wait_for_room(deadline)

    def usable(self, status: NodeStatus, now: float) -> bool:
        """Whether a live node may get new work: not draining, not refusing, its breaker closed."""
        node_id = status.info.node_id
        refused = self._refused.get(node_id, 0.0) >= now
        return not (status.draining or refused or self._breakers.is_open(node_id))

    async def _publish_rates(self) -> None:
        try:
            await self._index.set_cost_rates(self.cost.rates.to_json())
        except IndexUnavailable:
            self._membership.index_failed()

    async def _record_hits(self, node_id: NodeId, local: int, remote: int, miss: int) -> None:
        try:
            await self._index.record_hits(node_id, local, remote, miss)
        except IndexUnavailable:
            self._membership.index_failed()


def _holder(
    hits: dict[NodeId, int], known: Sequence[NodeStatus], prefill: NodeInfo | None, own_blocks: int
) -> tuple[NodeInfo | None, int]:
    """The live node (any role) holding the longest prefix of the prompt, when `prefill` (the node that will
    compute it) holds less: (holder, its blocks); else (None, 0)."""
    if prefill is None:
        return None, 0
    live = {s.info.node_id: s.info for s in known}
    best = max(
        ((n, node_id) for node_id, n in hits.items() if node_id != prefill.node_id and node_id in live),
        default=None,
    )
    if best is None or best[0] <= own_blocks:
        return None, 0
    return live[best[1]], best[0]
