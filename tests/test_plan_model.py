"""The planner's model (cli/plan_model.py) over plain inputs: sizing per role, the split of the current nodes,
hysteresis, dwell, and that no decision empties a role."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pdserve.cli.plan_model import (
    Damping,
    Load,
    Need,
    NodeView,
    Rates,
    RoleChange,
    Slo,
    decide,
    decode_slots,
    need,
)

RATES = Rates(prefill_tokens_per_s=10_000.0, decode_step_s=0.02, decode_step_s_per_seq=0.001)
SLO = Slo(ttft_s=1.0, tpot_s=0.05)


def nodes(prefill: int, decode: int, changed_at: float | None = None) -> list[NodeView]:
    return [NodeView(f"p{i}", "prefill", i, changed_at) for i in range(prefill)] + [
        NodeView(f"d{i}", "decode", i, changed_at) for i in range(decode)
    ]


def test_sizing_follows_the_queueing_and_step_models() -> None:
    n = need(Load(rate=10.0, prompt_tokens=2000, output_tokens=100), RATES, SLO)
    # s = 0.2 s per prompt, so u <= 0.8: 20,000 tokens/s over 8,000 per node
    assert n.prefill_utilisation == pytest.approx(0.8)
    assert n.prefill == pytest.approx(2.5)
    # b <= (0.05 - 0.02) / 0.001 = 30 sequences at 0.05 s a step: 600 tokens/s per node; 1,000 needed
    assert n.decode_batch == pytest.approx(30)
    assert n.decode == pytest.approx(1000 / 600)
    assert n.desired() == {"prefill": 3, "decode": 2}
    assert n.ttft_feasible and n.tpot_feasible


def test_a_decode_nodes_slots_bound_its_batch_below_what_the_tpot_allows() -> None:
    load = Load(rate=1.0, prompt_tokens=20, output_tokens=100)
    free = need(load, RATES, SLO)
    bound = need(load, RATES, SLO, slots=2)
    assert free.decode_batch == pytest.approx(30) and bound.decode_batch == 2
    # 2 sequences at 0.022 s a step: 2 / 0.022 tokens/s per node; 100 tokens/s needed
    assert bound.decode == pytest.approx(100 / (2 / 0.022))
    assert bound.tpot_feasible


def test_slots_are_the_fewer_of_max_num_seqs_and_the_streams_the_kv_holds() -> None:
    load = Load(rate=1.0, prompt_tokens=20, output_tokens=300)  # 320 tokens: 20 blocks of 16 a stream
    assert decode_slots(load, max_num_seqs=4, capacity_blocks=100, block_size=16) == 4
    assert decode_slots(load, max_num_seqs=64, capacity_blocks=100, block_size=16) == 5
    assert decode_slots(load, max_num_seqs=0, capacity_blocks=100, block_size=16) == 5  # an older node
    assert decode_slots(load, max_num_seqs=64, capacity_blocks=10, block_size=16) == 1  # at least one
    idle = Load(0.0, 0.0, 0.0)
    assert decode_slots(idle, max_num_seqs=0, capacity_blocks=100, block_size=16) == 100


def test_a_load_that_fills_the_decode_slots_moves_prefill_nodes_to_decode() -> None:
    """A CPU-like cluster (slow prefill, a loose TPOT): by the step time alone, one decode node is enough
    and the split stays; one sequence per decode node makes the same load need three."""
    cpu = Rates(prefill_tokens_per_s=200.0, decode_step_s=0.05, decode_step_s_per_seq=0.01)
    load = Load(rate=0.4, prompt_tokens=100, output_tokens=64)
    slo = Slo(ttft_s=2.0, tpot_s=0.3)
    assert decide(need(load, cpu, slo), nodes(2, 2), Damping(), now=1000.0).changes == ()
    bound = need(load, cpu, slo, slots=1)
    assert bound.decode == pytest.approx(0.4 * 64 * 0.06)
    d = decide(bound, nodes(2, 2), Damping(), now=1000.0)
    assert d.target_prefill == 1 and d.changes == (RoleChange("p0", "decode"),)


def test_an_slo_out_of_reach_is_flagged_and_sized_with_margin() -> None:
    n = need(Load(rate=1.0, prompt_tokens=20_000, output_tokens=10), RATES, Slo(ttft_s=1.0, tpot_s=0.01))
    assert not n.ttft_feasible and not n.tpot_feasible
    assert n.prefill == pytest.approx(2.0 / 0.05)
    assert n.decode_batch == 1.0


def test_a_prompt_heavy_load_moves_decode_nodes_to_prefill_the_least_busy_first() -> None:
    prompt_heavy = need(Load(rate=20.0, prompt_tokens=3000, output_tokens=4), RATES, SLO)
    d = decide(prompt_heavy, nodes(2, 2), Damping(), now=1000.0)
    assert d.reason == "move" and d.target_prefill == 3
    assert d.changes == (RoleChange("d0", "prefill"),)


def test_an_output_heavy_load_moves_prefill_nodes_to_decode_but_never_empties_prefill() -> None:
    output_heavy = need(Load(rate=20.0, prompt_tokens=20, output_tokens=500), RATES, SLO)
    d = decide(output_heavy, nodes(2, 2), Damping(), now=1000.0)
    assert d.target_prefill == 1 and d.changes == (RoleChange("p0", "decode"),)


def test_hysteresis_holds_a_split_near_the_rounding_point() -> None:
    # ideal 2.6 prefill of 4 rounds to 3, but it is only 0.6 from the current 2: within 0.5 + 0.25
    near = Need(prefill=2.6, decode=1.4, prefill_utilisation=1, decode_batch=1, ttft_feasible=True,
                tpot_feasible=True)  # fmt: skip
    assert decide(near, nodes(2, 2), Damping(margin=0.25), 0.0).reason == "hysteresis"
    assert decide(near, nodes(2, 2), Damping(margin=0.0), 0.0).changes == (RoleChange("d0", "prefill"),)


def test_dwell_keeps_a_recently_changed_node_in_its_role() -> None:
    heavy = Need(prefill=3.5, decode=0.5, prefill_utilisation=1, decode_batch=1, ttft_feasible=True,
                 tpot_feasible=True)  # fmt: skip
    recent = decide(heavy, nodes(1, 3, changed_at=90.0), Damping(dwell_s=30), now=100.0)
    assert recent.reason == "dwell" and recent.changes == ()
    later = decide(heavy, nodes(1, 3, changed_at=90.0), Damping(dwell_s=30), now=120.0)
    assert len(later.changes) == 2 and later.reason == "move"


def test_a_view_without_one_role_changes_nothing() -> None:
    heavy = Need(prefill=3.5, decode=0.5, prefill_utilisation=1, decode_batch=1, ttft_feasible=True,
                 tpot_feasible=True)  # fmt: skip
    assert decide(heavy, nodes(0, 3), Damping(dwell_s=0), 0.0).reason == "role_missing"


def test_no_load_changes_nothing() -> None:
    idle = need(Load(rate=0.0, prompt_tokens=0, output_tokens=0), RATES, SLO)
    assert decide(idle, nodes(2, 2), Damping(), 0.0).reason == "idle"


@given(
    prefill=st.integers(0, 6),
    decode=st.integers(0, 6),
    need_p=st.floats(0, 100),
    need_d=st.floats(0, 100),
    margin=st.floats(0, 1),
)
def test_no_decision_empties_a_role_or_moves_a_node_twice(
    prefill: int, decode: int, need_p: float, need_d: float, margin: float
) -> None:
    views = nodes(prefill, decode)
    n = Need(need_p, need_d, 1.0, 1.0, True, True)
    d = decide(n, views, Damping(margin=margin, dwell_s=0), 0.0)
    after = {v.node_id: v.role for v in views} | {c.node_id: c.to for c in d.changes}
    assert len({c.node_id for c in d.changes}) == len(d.changes)
    if len(views) >= 2 and d.changes:
        assert set(after.values()) == {"prefill", "decode"}
    if prefill >= 1 and decode >= 1:
        assert "prefill" in after.values() and "decode" in after.values()
    else:
        assert not d.changes


def test_a_move_waits_until_the_recent_rounds_agree() -> None:
    # the flapping seen live: one noisy round asks for 3 prefill nodes of 4 while the rounds before it asked
    # for 1: the nearest recent ideal to the current 1 is 1.1, so nothing moves
    noisy = Need(prefill=2.8, decode=1.2, prefill_utilisation=1, decode_batch=1, ttft_feasible=True,
                 tpot_feasible=True)  # fmt: skip
    d = decide(noisy, nodes(1, 3), Damping(dwell_s=0), now=10.0, recent=(1.1, 1.3))
    assert d.reason == "balanced" and d.changes == () and d.steady_prefill == pytest.approx(1.1)
    # rounds on both sides of the current count: hold
    assert decide(noisy, nodes(2, 2), Damping(dwell_s=0), 10.0, recent=(1.0,)).reason == "balanced"
    # every recent round past the margin: move, as far as the nearest of them says
    d = decide(noisy, nodes(1, 3), Damping(dwell_s=0), 10.0, recent=(2.9, 2.6))
    assert d.target_prefill == 3 and len(d.changes) == 2
