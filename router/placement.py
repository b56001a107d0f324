"""The one placement decision: for one prompt, the policy's pair and the cost model's option scored over the
same inputs, returned as one `Selection` that nobody edits afterwards. Pure Python over plain data, no I/O.

How it decides: the policy (router/policy.py) picks the decode node and, when P nodes exist, the prefill node
(with the cost model deciding, the policy never moves a prefill onto D itself); the cost model
(router/cost_model.py) estimates every way to prefill the prompt on that pair (local, local_fetch, pd,
pd_fetch) from the same hits and the in-flight ledger's queues. The option taken is the cost model's choice
when it decides and P/D is open; otherwise the policy's mode, with a fetch whenever another live node holds a
longer prefix than the prefilling node (and the estimate shows the fetch saves blocks).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from pdserve.router.cost_model import CostModel, Estimate, Inputs, Option
from pdserve.router.policy import Decision, NodeView, PolicyConfig, choose
from pdserve.shared.types import NodeId

Kind = str
"""The decision's kind in the metrics: pd, local (D prefills) or single."""
_KIND = {"disaggregated": "pd", "local_prefill": "local", "single": "single"}


@dataclass(frozen=True)
class Selection:
    """Where one prompt runs and what the router expects of it."""

    kind: Kind
    decode: NodeId
    prefill: NodeId | None
    """The prefill node of a P/D placement; None when the decode (or single) node prefills."""
    cached_blocks: int
    """Leading prompt blocks the index said the prefilling node holds."""
    fetch_from: NodeId | None
    """A live node the index said holds `fetch_blocks` leading blocks, more than the prefilling node: the
    prefilling node fetches them from it instead of computing them."""
    fetch_blocks: int
    score: float
    """The policy's score of the pair (token equivalents; lower was better)."""
    estimate: Estimate
    """The cost model's estimate of the option taken; its compute_tokens is what the ledger books."""
    inputs: Inputs

    @property
    def prefilling(self) -> NodeId:
        return self.decode if self.prefill is None else self.prefill

    @property
    def option(self) -> Option:
        return self.estimate.option


def select(
    prompt_tokens: int,
    block_size: int,
    hits: Mapping[NodeId, int],
    views: Sequence[NodeView],
    live: Collection[NodeId],
    policy: PolicyConfig,
    cost: CostModel,
    cost_decides: bool,
    queued: Callable[[NodeId], int],
    rotation: int,
) -> Selection:
    """Scores every option for the prompt and returns the one decision (NoNodeAvailable when none).

    hits: leading prompt blocks per node (the index lookup; {} while it is down); views: the nodes that may
    get the request, as the policy sees them; live: every live node, any role (a holder to fetch from);
    policy: with `cost_decides`, its local_prefill_max_tokens must be 0 (Router sees to it);
    queued: the in-flight ledger's booked prefill tokens of a node (the cost model's queue depth)."""
    full_blocks = prompt_tokens // block_size
    decision = choose(full_blocks, prompt_tokens, hits, views, policy, rotation, block_size=block_size)
    pd = decision.mode == "disaggregated"
    holder_p = _holder(hits, live, decision.prefill, decision.cached_blocks_prefill) if pd else None
    holder_d = None
    if cost_decides and pd:
        holder_d = _holder(hits, live, decision.decode, decision.cached_blocks_decode)
    inputs = Inputs(
        prompt_tokens, block_size, decision.cached_blocks_prefill, decision.cached_blocks_decode,
        0 if holder_p is None else hits[holder_p], queued(decision.prefill), queued(decision.decode), pd,
        0 if holder_d is None else hits[holder_d],
    )  # fmt: skip
    estimates = {e.option: e for e in cost.estimates(inputs)}
    option: Option
    if cost_decides and pd:
        option = cost.choose(inputs).option
    elif pd:
        option = "pd_fetch" if "pd_fetch" in estimates else "pd"
    else:
        option = "local"
    return _selection(decision, option, estimates[option], inputs, holder_p, holder_d, hits)


def _selection(
    decision: Decision,
    option: Option,
    estimate: Estimate,
    inputs: Inputs,
    holder_p: NodeId | None,
    holder_d: NodeId | None,
    hits: Mapping[NodeId, int],
) -> Selection:
    holder = {"pd_fetch": holder_p, "local_fetch": holder_d}.get(option)
    fetch_blocks = 0 if holder is None else hits[holder]
    if option in ("pd", "pd_fetch"):
        return Selection("pd", decision.decode, decision.prefill, decision.cached_blocks_prefill, holder,
                         fetch_blocks, decision.score, estimate, inputs)  # fmt: skip
    kind = "local" if decision.mode == "disaggregated" else _KIND[decision.mode]
    return Selection(kind, decision.decode, None, decision.cached_blocks_decode, holder, fetch_blocks,
                     decision.score, estimate, inputs)  # fmt: skip


def _holder(hits: Mapping[NodeId, int], live: Collection[NodeId], node: NodeId, own: int) -> NodeId | None:
    """The live node other than `node` holding the longest prefix of the prompt, when it holds more than
    `node`'s `own` blocks; else None."""
    best = max(((n, holder) for holder, n in hits.items() if holder != node and holder in live), default=None)
    return None if best is None or best[0] <= own else best[1]
