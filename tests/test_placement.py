"""The one placement decision (router/placement.py): pure unit tests over plain data."""

from __future__ import annotations

from pdserve.router.cost_model import CostModel, Rates
from pdserve.router.placement import select
from pdserve.router.policy import NodeView, PolicyConfig
from pdserve.shared.types import NodeId, Role

BS = 16
P0, P1, D0, S0 = NodeId("p0"), NodeId("p1"), NodeId("d0"), NodeId("s0")


def view(node: NodeId, role: Role) -> NodeView:
    return NodeView(node, role, kv_total_blocks=1000)


PD = [view(P0, "prefill"), view(P1, "prefill"), view(D0, "decode")]


def test_the_policys_pair_fetches_from_a_node_holding_more_of_the_prefix() -> None:
    """Without the cost model deciding, P/D stands and P fetches what another live node holds beyond its own
    (the holder need not be a candidate: a decode node, or one at its in-flight limit)."""
    holder = NodeId("d9")
    hits = {P0: 10, holder: 60}
    s = select(1024, BS, hits, PD, {P0, P1, D0, holder}, PolicyConfig(), CostModel(), False, lambda n: 0, 1)
    assert (s.kind, s.option, s.prefill, s.decode) == ("pd", "pd_fetch", P0, D0)
    assert (s.fetch_from, s.fetch_blocks, s.cached_blocks) == (holder, 60, 10)
    assert s.estimate.compute_tokens == 1024 - 60 * BS and s.prefilling == P0
    gone = select(1024, BS, hits, PD, {P0, P1, D0}, PolicyConfig(), CostModel(), False, lambda n: 0, 1)
    assert (gone.option, gone.fetch_from, gone.fetch_blocks) == ("pd", None, 0)  # a holder no longer live


def test_the_cost_model_moves_the_prefill_onto_d_and_the_decision_says_so_once() -> None:
    """D holds the whole prefix: the cost model prefills on D (no transfer), and the one decision names D as
    the prefilling node with D's cached blocks; nothing rewrites it afterwards."""
    cost = CostModel(Rates(transfer_s_per_block=1e-3))
    hits = {D0: 63}
    s = select(1024, BS, hits, PD, {P0, P1, D0}, PolicyConfig(), cost, True, lambda n: 0, 1)
    assert (s.kind, s.option, s.prefill, s.prefilling, s.cached_blocks) == ("local", "local", None, D0, 63)
    assert s.estimate.compute_tokens == 1024 - 63 * BS and s.fetch_from is None


def test_queues_are_the_ledgers_booked_tokens_and_single_nodes_prefill_themselves() -> None:
    queued = {S0: 500}
    single = [view(S0, "single")]
    s = select(100, BS, {}, single, {S0}, PolicyConfig(), CostModel(), False, lambda n: queued.get(n, 0), 3)
    assert (s.kind, s.option, s.prefill, s.decode) == ("single", "local", None, S0)
    assert s.inputs.queued_decode == 500 and s.estimate.compute_tokens == 100
