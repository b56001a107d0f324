"""Routing policy: pure unit tests over plain data (no Redis, no sockets)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pdserve.router.policy import NodeView, NoNodeAvailable, PolicyConfig, choose
from pdserve.shared.index.block_index_types import NodeInfo, NodeLoad, NodeStatus
from pdserve.shared.types import KVLayout, NodeId, Role


def view(name: str, role: Role, **kw: int | bool) -> NodeView:
    return NodeView(NodeId(name), role, **kw)  # type: ignore[arg-type]


P0, P1 = view("p0", "prefill"), view("p1", "prefill")
D0, D1 = view("d0", "decode", kv_total_blocks=1000), view("d1", "decode", kv_total_blocks=1000)


def test_prefill_goes_where_the_prefix_is_cached_and_decode_where_fewer_blocks_move() -> None:
    hits = {NodeId("p1"): 40, NodeId("d1"): 10}
    d = choose(64, 1024, hits, [P0, P1, D0, D1], block_size=16)
    assert (d.mode, d.prefill, d.decode) == ("disaggregated", "p1", "d1")
    assert d.tokens_to_compute == 1024 - 40 * 16
    assert (d.cached_blocks_prefill, d.cached_blocks_decode, d.blocks_to_transfer) == (40, 10, 54)


def test_a_block_the_prefill_node_lacks_costs_its_tokens_of_compute() -> None:
    """No node fetches a prefix from another: the holder of 100 of 106 blocks with a short queue beats an
    idle cold node (which would recompute all 1,700 tokens), and loses only to a queue longer than that."""
    holder = view("p1", "prefill", queued_prefill_tokens=300)
    d = choose(106, 1700, {NodeId("p1"): 100, NodeId("d0"): 8}, [P0, holder, D0], block_size=16)
    assert (d.prefill, d.tokens_to_compute, d.cached_blocks_prefill) == ("p1", 1700 - 1600, 100)
    assert d.score == pytest.approx(300 + 100 + (107 - 8) * 0.5 + (107 - 8) / 1000 * 256)
    assert d.blocks_to_transfer == 107 - 8  # ceil(1700 / 16) blocks, minus the ones D holds
    busy = view("p1", "prefill", queued_prefill_tokens=5000)
    d = choose(106, 1700, {NodeId("p1"): 100}, [P0, busy, D0], block_size=16)
    assert (d.prefill, d.tokens_to_compute, d.cached_blocks_prefill) == ("p0", 1700, 0)


def test_queue_depth_and_decode_load_steer_choices() -> None:
    p_busy = view("p0", "prefill", queued_prefill_tokens=4096)
    d_busy = view("d0", "decode", running=30, kv_used_blocks=900, kv_total_blocks=1000)
    d = choose(4, 70, {}, [p_busy, P1, d_busy, D1], block_size=16)
    assert (d.prefill, d.decode) == ("p1", "d1")


def test_a_decode_node_without_room_ranks_last() -> None:
    full = view("d0", "decode", kv_used_blocks=998, kv_total_blocks=1000)  # 4 more blocks do not fit
    roomy = view("d1", "decode", running=60, kv_used_blocks=10, kv_total_blocks=1000)
    assert choose(64, 1024, {NodeId("d0"): 60}, [P0, full, roomy], block_size=16).decode == "d1"


def test_draining_nodes_get_no_new_work() -> None:
    hits = {NodeId("p0"): 64, NodeId("d0"): 64}
    d = choose(
        64,
        1024,
        hits,
        [view("p0", "prefill", draining=True), P1, view("d0", "decode", draining=True), D1],
        block_size=16,
    )
    assert (d.prefill, d.decode) == ("p1", "d1")
    assert d.tokens_to_compute == 1024 and d.cached_blocks_prefill == 0
    with pytest.raises(NoNodeAvailable, match=r"d0 \(decode, draining\)"):
        choose(1, 16, {}, [P0, view("d0", "decode", draining=True)], block_size=16)


def test_ties_are_spread_by_rotation() -> None:
    picks = Counter(
        (d.prefill, d.decode)
        for r in range(8)
        for d in [choose(1, 20, {}, [P0, P1, D0, D1], None, r, block_size=16)]
    )
    assert set(picks) == {("p0", "d0"), ("p1", "d1")} and set(picks.values()) == {4}
    busier = view("p0", "prefill", running=3)  # equal score, more requests: the other wins every time
    assert {choose(1, 20, {}, [busier, P1, D0], None, r, block_size=16).prefill for r in range(4)} == {"p1"}


def test_single_nodes_and_fallbacks() -> None:
    s0, s1 = view("s0", "single", running=2), view("s1", "single", running=2)
    d = choose(8, 128, {NodeId("s0"): 8}, [s0, s1], block_size=16)
    assert (d.mode, d.prefill, d.decode, d.blocks_to_transfer) == ("single", "s0", "s0", 0)
    assert d.tokens_to_compute == 1  # fully cached: only the last token is computed for its logits
    only_decode = choose(8, 128, {}, [D0], block_size=16)
    assert (only_decode.mode, only_decode.prefill, only_decode.decode) == ("local_prefill", "d0", "d0")
    with pytest.raises(NoNodeAvailable, match="live: p0 \\(prefill\\)"):
        choose(8, 128, {}, [P0], block_size=16)
    with pytest.raises(NoNodeAvailable, match="live: none"):
        choose(8, 128, {}, [], block_size=16)


def test_short_suffix_is_prefilled_on_decode_when_configured() -> None:
    cfg = PolicyConfig(local_prefill_max_tokens=64)
    long_cold = choose(32, 520, {NodeId("d0"): 30}, [P0, D0], cfg, block_size=16)
    assert long_cold.mode == "local_prefill" and long_cold.tokens_to_compute == 520 - 480
    assert choose(32, 520, {}, [P0, D0], cfg, block_size=16).mode == "disaggregated"
    assert (
        choose(32, 520, {NodeId("d0"): 30}, [P0, D0], block_size=16).mode == "disaggregated"
    )  # default: off


def test_bad_inputs_name_the_values() -> None:
    with pytest.raises(ValueError, match="prompt_tokens=0"):
        choose(0, 0, {}, [P0, D0], block_size=16)
    with pytest.raises(ValueError, match="prompt_blocks=5"):
        choose(5, 70, {}, [P0, D0], block_size=16)
    with pytest.raises(ValueError, match="block_size=0"):
        choose(1, 16, {}, [P0, D0], block_size=0)


def test_node_view_from_status() -> None:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=16, dtype="float32")
    info = NodeInfo(
        NodeId("d0"), "decode", "http://x", "x:1", "ab" * 32, layout, 1, 100, "cd" * 32, 8192, epoch=3
    )
    load = NodeLoad(
        running=2, waiting=1, kv_used_blocks=7, kv_total_blocks=100, blocks_held=9, queued_prefill_tokens=33
    )
    v = NodeView.from_status(NodeStatus(info, load, 0.1, True, 9))
    assert (v.running, v.waiting, v.kv_used_blocks, v.kv_total_blocks, v.queued_prefill_tokens) == (
        2,
        1,
        7,
        100,
        33,
    )
    assert v.draining and NodeView.from_status(NodeStatus(info, None, 0.1, False, 0)).kv_total_blocks == 0


nodes_strategy = st.lists(
    st.builds(
        NodeView,
        node_id=st.sampled_from([NodeId(f"n{i}") for i in range(6)]),
        role=st.sampled_from(["prefill", "decode", "single"]),
        running=st.integers(0, 50),
        waiting=st.integers(0, 50),
        queued_prefill_tokens=st.integers(0, 10_000),
        kv_used_blocks=st.integers(0, 1000),
        kv_total_blocks=st.sampled_from([0, 1000]),
        draining=st.booleans(),
    ),
    max_size=6,
    unique_by=lambda n: n.node_id,
)


@given(
    nodes=nodes_strategy,
    tokens=st.integers(1, 5000),
    hits=st.dictionaries(st.sampled_from([NodeId(f"n{i}") for i in range(8)]), st.integers(0, 400)),
    rotation=st.integers(0, 100),
)
def test_decision_invariants(
    nodes: list[NodeView], tokens: int, hits: dict[NodeId, int], rotation: int
) -> None:
    blocks = tokens // 16
    try:
        d = choose(blocks, tokens, hits, nodes, None, rotation, block_size=16)
    except NoNodeAvailable:
        assert not any(n.role in ("decode", "single") and not n.draining for n in nodes)
        return
    by_id = {n.node_id: n for n in nodes}
    assert not by_id[d.prefill].draining and not by_id[d.decode].draining
    roles = (by_id[d.prefill].role, by_id[d.decode].role)
    expected = {
        "disaggregated": ("prefill", "decode"),
        "local_prefill": ("decode", "decode"),
        "single": ("single",) * 2,
    }
    assert roles == expected[d.mode]
    assert 1 <= d.tokens_to_compute <= tokens
    assert 0 <= d.cached_blocks_prefill <= blocks
    assert d.tokens_to_compute == max(1, tokens - 16 * d.cached_blocks_prefill)
    assert d.score >= by_id[d.prefill].queued_prefill_tokens + d.tokens_to_compute
    assert d.blocks_to_transfer == (
        -(-tokens // 16) - d.cached_blocks_decode if d.mode == "disaggregated" else 0
    )
