"""Which cached prefixes a drain moves (shared/engine/prefix_heat.py) and where (kvctl/move_prefixes.py
`target`, the router's policy over the other nodes): hits and recency rank the chains, the byte budget cuts
them, shared blocks count once, evicted tails are trimmed; hits on moved blocks are counted until the pool
reports them removed; the target is the node of the draining node's role the policy would pick; the move's
messages round-trip."""

from __future__ import annotations

import hashlib
import json

import pytest
from pdserve.kvctl.move_prefixes import target
from pdserve.shared.engine.prefix_heat import PrefixHeat
from pdserve.shared.index.block_index_types import NodeInfo, NodeLoad, NodeStatus
from pdserve.shared.node.move_protocol import (
    DrainNote,
    HotPrefix,
    HotPrefixes,
    HotPrefixesRequest,
    PullPrefix,
    PullResult,
)
from pdserve.shared.node.node_protocol import PROTOCOL_VERSION
from pdserve.shared.types import BlockHash, KVLayout, NodeId, Role


def chain(name: str, n: int) -> list[BlockHash]:
    return [BlockHash(hashlib.sha256(f"{name}{i}".encode()).digest()) for i in range(n)]


def everything(hashes: object) -> int:
    return len(hashes)  # type: ignore[arg-type]


def test_hits_then_recency_rank_the_chains() -> None:
    heat = PrefixHeat()
    a, b, c = chain("a", 4), chain("b", 3), chain("c", 2)
    heat.hit(a, 4)
    heat.hit(b, 3)
    heat.hit(b, 3)
    heat.hit(c, 2)  # one hit like a, but later
    got = heat.hottest(everything, 100)
    assert [list(g.hashes) for g in got] == [b, c, a]
    assert [g.hits for g in got] == [2, 1, 1]


def test_the_budget_cuts_the_last_chain_and_shared_blocks_count_once() -> None:
    heat = PrefixHeat()
    shared = chain("s", 4)
    longer = [*shared, *chain("tail", 3)]
    heat.hit(shared, 4)
    heat.hit(shared, 4)
    heat.hit(longer, 7)
    got = heat.hottest(everything, 6)  # 4 shared + 2 of the 3 tail blocks
    assert [list(g.hashes) for g in got] == [shared, longer[:6]]
    assert heat.hottest(everything, 0) == []


def test_a_chain_is_trimmed_to_what_the_pool_still_holds() -> None:
    heat = PrefixHeat()
    a = chain("a", 5)
    heat.hit(a, 5)
    assert [list(g.hashes) for g in heat.hottest(lambda hs: 2, 100)] == [a[:2]]
    assert heat.hottest(lambda hs: 0, 100) == []


def test_the_least_recently_hit_chain_is_dropped_past_the_cap() -> None:
    heat = PrefixHeat(max_chains=2)
    a, b, c = chain("a", 1), chain("b", 1), chain("c", 1)
    heat.hit(a, 1)
    heat.hit(b, 1)
    heat.hit(a, 1)
    heat.hit(c, 1)
    assert sorted(g.hashes[0] for g in heat.hottest(everything, 10)) == sorted([a[0], c[0]])


def test_hits_on_moved_blocks_are_counted_until_they_leave() -> None:
    heat = PrefixHeat()
    a = chain("a", 4)
    heat.hit(a, 4)
    assert heat.moved_hit_blocks == 0
    heat.mark_moved(a[1:])
    heat.hit(a, 4)
    heat.hit(a, 2)
    assert heat.moved_hit_blocks == 3 + 1
    heat.forget(a[2:])
    heat.hit(a, 4)
    assert heat.moved_hit_blocks == 4 + 1


def status(node: str, role: Role, running: int = 0, draining: bool = False) -> NodeStatus:
    layout = KVLayout(1, 1, 1, 16, "float32", 1)
    info = NodeInfo(NodeId(node), role, f"http://{node}", "", "0" * 64, layout, 1, 100, "0" * 64, 2048)
    load = NodeLoad(running, 0, 0, 100, 0, draining=draining)
    return NodeStatus(info, load, 0.0, draining, 0)


def test_the_target_is_the_node_of_the_same_role_the_policy_picks() -> None:
    p0, p1, p2 = status("p0", "prefill"), status("p1", "prefill"), status("p2", "prefill")
    d0 = status("d0", "decode")
    hits = {NodeId("p2"): 3}
    assert target(4, 16, hits, p0, [p1, p2, d0]) == "p2"  # it holds most of the chain already
    assert target(4, 16, {}, p0, [p1, d0]) == "p1"
    assert target(4, 16, {}, p0, [d0]) is None  # no other prefill node: D would prefill it
    assert target(4, 16, {}, p0, [status("p1", "prefill", draining=True), d0]) is None
    d1 = status("d1", "decode", running=3)
    d2 = status("d2", "decode")
    assert target(4, 16, {}, status("d0", "decode"), [p1, d1, d2]) == "d2"  # the less loaded decode node


def test_the_move_messages_round_trip_and_refuse_bad_hashes() -> None:
    hashes = tuple(chain("m", 2))
    messages = [
        HotPrefixesRequest(1 << 30),
        HotPrefixes(NodeId("p0"), 16, 737280, (HotPrefix(hashes, 3, 1.5),)),
        PullPrefix(NodeId("p0"), "http://127.0.0.1:1", hashes, 1e9),
        PullResult(2, 0, 2, 1474560),
        PullResult(2, 0, 0, 0, error="no room: 1 allocatable KV blocks here", no_room=True),
        DrainNote(1, 1474560),
        DrainNote(0, 0, why_not="p1: no room (1 prefixes)"),
        DrainNote(migrate=True),
        DrainNote(2, 100, migrate=True),
    ]
    for msg in messages:
        assert type(msg).from_json(msg.to_json()) == msg
    obj = json.loads(PullPrefix(NodeId("p0"), "http://h", hashes, 1e9).to_json())
    obj["block_hashes"] = ["00" * 31]
    with pytest.raises(ValueError, match="32-byte"):
        PullPrefix.from_json(json.dumps(obj))
    with pytest.raises(ValueError, match="budget_bytes"):
        HotPrefixesRequest.from_json(json.dumps({"v": PROTOCOL_VERSION, "budget_bytes": -1}))
