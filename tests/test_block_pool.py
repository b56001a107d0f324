"""Block pool on tiny pools: exact block ids, exact eviction order, events, errors that change nothing."""

from __future__ import annotations

import hashlib

import pytest
from pdserve.shared.engine.block_pool import (
    BlockPool,
    BlockRemoved,
    BlockStored,
    NoFreeBlocks,
    PoolAudit,
)
from pdserve.shared.types import BlockHash, BlockId


def h(name: str) -> BlockHash:
    return BlockHash(hashlib.sha256(name.encode()).digest())


def ids(*values: int) -> list[BlockId]:
    return [BlockId(v) for v in values]


def commit_chain(pool: BlockPool, blocks: list[BlockId], names: list[str]) -> None:
    parent: BlockHash | None = None
    for block, name in zip(blocks, names, strict=True):
        assert pool.commit(block, h(name), parent) == block
        parent = h(name)


def test_fresh_pool_allocates_ascending_ids() -> None:
    pool = BlockPool(4, block_size=2)
    assert pool.num_free() == 4
    assert pool.allocate(3) == ids(0, 1, 2)
    assert pool.audit() == PoolAudit(num_blocks=4, free=1, cached=0, in_use=3, reserved=0)
    pool.release(ids(2, 1, 0))
    assert pool.audit().free == 4
    assert pool.allocate(4) == ids(3, 2, 1, 0)  # unhashed blocks return to the free list's tail, in order
    pool.check_invariants()


def test_release_in_reverse_evicts_chain_tails_first() -> None:
    pool = BlockPool(6)
    a = pool.allocate(3)
    commit_chain(pool, a, ["a0", "a1", "a2"])
    b = pool.allocate(3)
    commit_chain(pool, b, ["b0", "b1", "b2"])
    pool.release(list(reversed(a)))
    pool.release(list(reversed(b)))
    assert pool.audit().cached == 6 and pool.num_free() == 6
    pool.drain_events()
    assert pool.allocate(1) == ids(2)  # a's tail goes first
    assert pool.allocate(2) == ids(1, 0)
    assert pool.match_prefix([h("a0")]) == []
    assert pool.match_prefix([h("b0"), h("b1"), h("b2")]) == ids(3, 4, 5)
    assert pool.drain_events() == [BlockRemoved((h("a2"), h("a1"), h("a0")))]
    pool.check_invariants()


def test_free_blocks_are_taken_before_cached_ones() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    commit_chain(pool, a, ["x", "y"])
    pool.release(a[::-1])
    assert pool.allocate(2) == ids(2, 3)
    assert pool.match_prefix([h("x"), h("y")]) == ids(0, 1)
    assert pool.allocate(1) == ids(1)  # then the LRU head: y, released first
    assert pool.match_prefix([h("x"), h("y")]) == ids(0)


def test_acquire_takes_cached_block_out_of_lru_and_release_refreshes_it() -> None:
    pool = BlockPool(3)
    a = pool.allocate(2)
    commit_chain(pool, a, ["p0", "p1"])
    pool.release(a[::-1])  # LRU: 1, 0
    hit = pool.match_prefix([h("p0"), h("p1"), h("p2")])
    assert hit == ids(0, 1)
    pool.acquire(hit[:1])  # block 0 leaves the LRU
    assert pool.audit() == PoolAudit(3, free=1, cached=1, in_use=1, reserved=0)
    pool.release(hit[:1])  # block 0 back at the LRU tail: 1, 0
    assert pool.allocate(3) == ids(2, 1, 0)


def test_match_prefix_stops_at_first_miss_and_takes_no_reference() -> None:
    pool = BlockPool(4)
    a = pool.allocate(3)
    commit_chain(pool, a, ["m0", "m1", "m2"])
    pool.release(a[::-1])
    pool.evict([h("m1")])
    assert pool.match_prefix([h("m0"), h("m1"), h("m2")]) == ids(0)
    assert pool.audit().in_use == 0
    assert pool.match_prefix([]) == []


def test_duplicate_commit_returns_existing_block_and_keeps_own_unhashed() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.commit(a, h("same"), None) == a
    assert pool.commit(b, h("same"), None) == a
    assert pool.drain_events() == [BlockStored((h("same"),), None)]
    assert pool.held_hashes() == [h("same")]
    pool.release([b])  # unhashed: to the free list, not the LRU
    assert pool.audit() == PoolAudit(4, free=3, cached=0, in_use=1, reserved=0)
    pool.check_invariants()


def test_second_hash_write_is_an_assertion() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.commit(a, h("one"), None)
    with pytest.raises(AssertionError, match="already has hash"):
        pool.commit(a, h("two"), h("one"))
    with pytest.raises(AssertionError, match="already has hash"):
        pool.commit(a, h("one"), None)


def test_no_free_blocks_leaves_state_unchanged() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    commit_chain(pool, a, ["k0", "k1"])
    pool.release(a[::-1])
    pool.allocate(1)
    pool.drain_events()
    before = (pool.audit(), pool.held_hashes())
    for take in (pool.allocate, pool.reserve):
        with pytest.raises(NoFreeBlocks, match="need 4 blocks, 3 allocatable"):
            take(4)
    assert (pool.audit(), pool.held_hashes()) == before
    assert pool.drain_events() == []
    pool.check_invariants()


def test_reservation_is_not_matchable_or_committable_until_filled() -> None:
    pool = BlockPool(4)
    r = pool.reserve(2)
    assert r == ids(0, 1)
    assert pool.audit() == PoolAudit(4, free=2, cached=0, in_use=0, reserved=2)
    with pytest.raises(ValueError, match="RESERVED"):
        pool.commit(r[0], h("r0"), None)
    with pytest.raises(ValueError, match="RESERVED"):
        pool.acquire(r[:1])
    assert pool.match_prefix([h("r0")]) == []
    pool.fill_done(r)
    with pytest.raises(ValueError, match="not reserved"):
        pool.fill_done(r)
    commit_chain(pool, r, ["r0", "r1"])
    assert pool.match_prefix([h("r0"), h("r1")]) == r
    assert pool.audit() == PoolAudit(4, free=2, cached=0, in_use=2, reserved=0)


def test_aborted_reservation_returns_to_free_list() -> None:
    pool = BlockPool(3)
    r = pool.reserve(3)
    pool.release(r[::-1])
    assert pool.audit() == PoolAudit(3, free=3, cached=0, in_use=0, reserved=0)
    assert pool.drain_events() == []
    pool.check_invariants()


def test_evict_selected_and_all_cached_blocks() -> None:
    pool = BlockPool(5)
    a = pool.allocate(3)
    commit_chain(pool, a, ["e0", "e1", "e2"])
    pool.release(a[1:][::-1])  # e0 stays in use
    pool.drain_events()
    assert pool.evict([h("e0"), h("e2"), h("missing"), h("e2")]) == 1  # e0 in use: untouched
    assert pool.drain_events() == [BlockRemoved((h("e2"),))]
    assert pool.evict() == 1
    assert pool.held_hashes() == [h("e0")]
    assert pool.audit() == PoolAudit(5, free=4, cached=0, in_use=1, reserved=0)
    pool.check_invariants()


def test_events_are_coalesced_in_order() -> None:
    pool = BlockPool(4)
    a = pool.allocate(4)
    commit_chain(pool, a[:2], ["c0", "c1"])
    pool.commit(a[2], h("c2"), h("c1"))
    pool.commit(a[3], h("d0"), None)  # a new chain starts a new batch
    pool.release(a[::-1])
    pool.evict([h("d0")])
    pool.evict([h("c2")])
    assert pool.allocate(4) == ids(3, 2, 1, 0)  # the evicted blocks, then the LRU head c1, then c0
    assert pool.drain_events() == [
        BlockStored((h("c0"), h("c1"), h("c2")), None),
        BlockStored((h("d0"),), None),
        BlockRemoved((h("d0"), h("c2"), h("c1"), h("c0"))),
    ]
    assert pool.drain_events() == []


def test_misuse_is_refused_without_side_effects() -> None:
    pool = BlockPool(3)
    a = pool.allocate(2)
    before = pool.audit()
    with pytest.raises(ValueError, match="outside"):
        pool.release([a[0], BlockId(7)])
    with pytest.raises(ValueError, match="asked to release 2"):
        pool.release([a[1], a[1]])
    with pytest.raises(ValueError, match="FREE"):
        pool.acquire([a[0], BlockId(2)])
    with pytest.raises(ValueError, match="FREE"):
        pool.commit(BlockId(2), h("f"), None)
    with pytest.raises(ValueError, match="32 bytes"):
        pool.commit(a[0], BlockHash(b"short"), None)
    with pytest.raises(ValueError, match="cannot allocate -1"):
        pool.allocate(-1)
    assert pool.audit() == before
    with pytest.raises(ValueError, match="must be positive"):
        BlockPool(0)
    pool.check_invariants()
