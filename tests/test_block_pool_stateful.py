"""Hypothesis state machine over the block pool: random request lifecycles against a model of who holds what.

After every step the pool's own invariants hold, its audit matches the model's count of held and reserved
blocks, blocks held by a request still carry their hashes, every allocation that evicts takes the
model LRU's head, over-releases are refused, and the Stored/Removed events replayed into an index give
exactly the pool's held hashes. At teardown everything is released and the pool is back to all-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from pdserve.shared.engine.block_hash import hash_blocks, hash_seed
from pdserve.shared.engine.block_pool import BlockPool, BlockRemoved, BlockStored, BlockTiered, NoFreeBlocks
from pdserve.shared.types import BlockHash, BlockId

BLOCK_SIZE = 2
NUM_BLOCKS = 12
SEED = hash_seed(bytes(32), "stateful")
# Prompts are a cut of one of three base prompts plus a short tail, so requests share prefixes often.
BASES = ([0, 1, 2, 0, 1, 2, 0, 1], [0, 1, 2, 0, 2, 2, 1, 1], [1, 1, 1, 1, 0, 0, 0, 0])
TOKENS = st.builds(
    lambda base, cut, tail: base[:cut] + tail,
    st.sampled_from(BASES),
    st.integers(0, 8),
    st.lists(st.integers(0, 2), max_size=3),
)


@dataclass
class Seq:
    tokens: list[int]
    blocks: list[BlockId]
    committed: int  # leading full blocks whose hash is committed (by this sequence or found cached)
    dups: list[int] = field(default_factory=list)  # blocks whose commit found the hash on another block

    def hashes(self) -> list[BlockHash]:
        return hash_blocks(self.tokens, BLOCK_SIZE, SEED)

    def hashed(self) -> list[int]:
        """Indices of this sequence's blocks that carry their hash (committed here or matched)."""
        return [i for i in range(self.committed) if i not in self.dups]


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, BLOCK_SIZE)
        self.seqs: dict[int, Seq] = {}
        self.reservations: dict[int, tuple[list[int], list[BlockId]]] = {}
        self.lru: list[BlockId] = []  # the model's cached-free blocks, next to evict first
        self.indexed: set[BlockHash] = set()  # the index a node's Stored/Removed events would build
        self.parent_of: dict[BlockHash, BlockHash | None] = {}
        self.next_key = 0

    def _key(self) -> int:
        self.next_key += 1
        return self.next_key

    def _refs(self, block: BlockId) -> int:
        held = [b for s in self.seqs.values() for b in s.blocks]
        return held.count(block) + sum(ids.count(block) for _, ids in self.reservations.values())

    def _hashed_blocks(self) -> set[BlockId]:
        return {b for h in self.pool.held_hashes() for b in self.pool.match_prefix([h])}

    def _take_refs(self, blocks: Sequence[BlockId]) -> None:
        self.lru = [b for b in self.lru if b not in blocks]

    def _dropped_refs(self, blocks: Sequence[BlockId]) -> None:
        """Blocks whose last reference went (in this order) join the LRU tail if they carry a hash."""
        hashed = self._hashed_blocks()
        self.lru += [b for b in blocks if b in hashed and self._refs(b) == 0]

    def _take(self, n: int, reserve: bool) -> list[BlockId] | None:
        before = (self.pool.audit(), self.pool.held_hashes(), self.pool.num_free())
        try:
            got = self.pool.reserve(n) if reserve else self.pool.allocate(n)
        except NoFreeBlocks:
            assert n > before[2]
            assert (self.pool.audit(), self.pool.held_hashes(), self.pool.num_free()) == before
            return None
        evicted = max(0, n - before[0].free)  # free blocks first, then the LRU head
        assert got[n - evicted :] == self.lru[:evicted]
        del self.lru[:evicted]
        return got

    @rule(tokens=TOKENS)
    def new_request(self, tokens: list[int]) -> None:
        """Share the cached prefix (match + acquire), allocate the rest; on refusal give the prefix back."""
        hit = self.pool.match_prefix(hash_blocks(tokens, BLOCK_SIZE, SEED))
        self.pool.acquire(hit)
        self._take_refs(hit)
        new = self._take(blocks_for(len(tokens)) - len(hit), reserve=False)
        if new is None:
            self.pool.release(hit[::-1])
            self._dropped_refs(hit[::-1])
            return
        self.seqs[self._key()] = Seq(tokens, hit + new, committed=len(hit))

    @precondition(lambda self: any(s.committed < len(s.hashes()) for s in self.seqs.values()))
    @rule(data=st.data())
    def commit_full_blocks(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from([k for k, s in self.seqs.items() if s.committed < len(s.hashes())]))
        seq = self.seqs[key]
        hashes = seq.hashes()
        for i in range(seq.committed, data.draw(st.integers(seq.committed + 1, len(hashes)))):
            self.parent_of[hashes[i]] = hashes[i - 1] if i else None
            got = self.pool.commit(seq.blocks[i], hashes[i], self.parent_of[hashes[i]])
            if got != seq.blocks[i]:  # another request committed this block first; ours stays unhashed
                assert self.pool.match_prefix(hashes[i : i + 1]) == [got]
                seq.dups.append(i)
            seq.committed += 1

    @precondition(lambda self: any(s.hashed() for s in self.seqs.values()))
    @rule(data=st.data())
    def second_hash_write_is_refused(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from([s for s in self.seqs.values() if s.hashed()]))
        i = data.draw(st.sampled_from(seq.hashed()))
        with pytest.raises(AssertionError, match="already has hash"):
            self.pool.commit(seq.blocks[i], BlockHash(bytes(32)), None)

    @rule(block=st.integers(0, NUM_BLOCKS - 1))
    def over_release_is_refused(self, block: int) -> None:
        """Releasing more references than requests and reservations hold changes nothing."""
        before = self.pool.audit()
        with pytest.raises(ValueError, match="references"):
            self.pool.release([BlockId(block)] * (self._refs(BlockId(block)) + 1))
        assert self.pool.audit() == before

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data(), more=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def grow(self, data: st.DataObject, more: list[int]) -> None:
        """Decode appends tokens; new blocks reuse whatever the pool hands out (free, then evicted)."""
        seq = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
        new = self._take(blocks_for(len(seq.tokens) + len(more)) - len(seq.blocks), reserve=False)
        if new is not None:
            seq.tokens += more
            seq.blocks += new

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self._finish(data.draw(st.sampled_from(sorted(self.seqs))))

    def _finish(self, key: int) -> Seq:
        seq = self.seqs.pop(key)
        self.pool.release(seq.blocks[::-1])  # last block first: chain tails reach the LRU head
        self._dropped_refs(seq.blocks[::-1])
        return seq

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data())
    def preempt_and_resume(self, data: st.DataObject) -> None:
        """Preemption frees a request; resuming it at once finds its hashed blocks, cached, up to the first
        block whose hash lives on another request's block (that one may have been evicted meanwhile)."""
        seq = self._finish(data.draw(st.sampled_from(sorted(self.seqs))))
        kept = min([*seq.dups, seq.committed])
        assert self.pool.match_prefix(seq.hashes())[:kept] == seq.blocks[:kept]
        self.new_request(seq.tokens)

    @rule(tokens=TOKENS)
    def reserve(self, tokens: list[int]) -> None:
        got = self._take(blocks_for(len(tokens)), reserve=True)
        if got is not None:
            self.reservations[self._key()] = (tokens, got)

    @precondition(lambda self: bool(self.reservations))
    @rule(data=st.data())
    def fill(self, data: st.DataObject) -> None:
        tokens, block_ids = self.reservations.pop(data.draw(st.sampled_from(sorted(self.reservations))))
        self.pool.fill_done(block_ids)
        self.seqs[self._key()] = Seq(tokens, block_ids, committed=0)

    @precondition(lambda self: bool(self.reservations))
    @rule(data=st.data())
    def abort_reservation(self, data: st.DataObject) -> None:
        _, block_ids = self.reservations.pop(data.draw(st.sampled_from(sorted(self.reservations))))
        self.pool.release(block_ids[::-1])
        self._dropped_refs(block_ids[::-1])

    @rule(data=st.data(), everything=st.booleans())
    def evict(self, data: st.DataObject, everything: bool) -> None:
        chosen: list[BlockHash] | None = None  # None: everything
        if not everything:
            held = self.pool.held_hashes()
            chosen = data.draw(st.lists(st.sampled_from(held), max_size=3)) if held else []
        off_device = self._evicted_off_device(chosen)
        if chosen is None:
            assert self.pool.evict() == len(self.lru) + off_device
            self.lru = []
        else:
            targets = {b for h in chosen for b in self.pool.match_prefix([h])}
            assert self.pool.evict(chosen) == len(targets & set(self.lru)) + off_device
            self._take_refs(list(targets))
        assert self.pool.audit().cached == len(self.lru)

    def _evicted_off_device(self, chosen: list[BlockHash] | None) -> int:
        """How many entries evict(chosen) drops besides device blocks (None: everything); a pool without a
        host tier has none."""
        return 0

    @rule()
    def drain(self) -> None:
        for event in self.pool.drain_events():
            if isinstance(event, BlockStored):
                parents = [event.parent_hash, *event.block_hashes[:-1]]
                for parent, child in zip(parents, event.block_hashes, strict=True):
                    assert child not in self.indexed
                    assert parent == self.parent_of[child]
                    self.indexed.add(child)
            else:
                assert isinstance(event, BlockRemoved)
                for gone in event.block_hashes:
                    self.indexed.remove(gone)
        assert self.indexed == set(self.pool.held_hashes())

    @invariant()
    def pool_matches_model(self) -> None:
        self.pool.check_invariants()
        audit = self.pool.audit()
        held = {b for s in self.seqs.values() for b in s.blocks}
        assert audit.reserved == sum(len(ids) for _, ids in self.reservations.values())
        assert audit.in_use == len(held)
        assert audit.cached == len(self.lru) and audit.free + audit.cached == self.pool.num_free()
        assert self.pool.num_free() == NUM_BLOCKS - len(held) - audit.reserved
        reserved = {b for _, ids in self.reservations.values() for b in ids}
        assert not reserved & self._hashed_blocks()
        for seq in self.seqs.values():
            for i in seq.hashed():  # a held block keeps its hash: eviction never touches it
                assert self.pool.match_prefix(seq.hashes()[i : i + 1]) == [seq.blocks[i]]

    def teardown(self) -> None:
        for seq in self.seqs.values():
            self.pool.release(seq.blocks[::-1])
        for _, block_ids in self.reservations.values():
            self.pool.release(block_ids[::-1])
        self.pool.check_invariants()
        audit = self.pool.audit()
        assert (audit.in_use, audit.reserved) == (0, 0)
        assert audit.free + audit.cached == NUM_BLOCKS
        self.pool.evict()
        assert self.pool.audit().free == NUM_BLOCKS and self.pool.held_hashes() == []
        self.pool.check_invariants()
        self.drain()  # the events, replayed from the start, leave an empty index
        assert self.indexed == set()


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockPoolStateful = PoolMachine.TestCase


HOST_BLOCKS = 3


class TieredPoolMachine(PoolMachine):
    """The same lifecycles over a pool with a host tier, plus restores; besides the pool's invariants, the
    tier's copies are run in queue order over a model of the bytes (each block's and slot's content is the
    hash it was computed for), and every held device block and host slot must then hold its own hash's
    bytes; the Stored/Removed/Tiered events replay into the node's holdings and its host list."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, BLOCK_SIZE, HOST_BLOCKS)
        self.dev_data: dict[BlockId, BlockHash | None] = {}
        self.host_data: dict[int, BlockHash | None] = {}
        self.host_indexed: set[BlockHash] = set()

    @precondition(lambda self: any(s.committed < len(s.hashes()) for s in self.seqs.values()))
    @rule(data=st.data())
    def commit_full_blocks(self, data: st.DataObject) -> None:
        before = {k: s.committed for k, s in self.seqs.items()}
        super().commit_full_blocks(data)
        for key, seq in self.seqs.items():  # the forward wrote these blocks' bytes before the commit
            for i in range(before[key], seq.committed):
                if i not in seq.dups:
                    self.dev_data[seq.blocks[i]] = seq.hashes()[i]

    @rule(tokens=TOKENS)
    def restore(self, tokens: list[int]) -> None:
        assert self.pool.host is not None
        hashes = hash_blocks(tokens, BLOCK_SIZE, SEED)
        dev = self.pool.match_prefix(hashes)
        run = self.pool.host.leading(hashes[len(dev) :])
        free_before = self.pool.audit().free
        n = self.pool.restore(hashes)
        if not run:
            assert n == 0
            return
        self._take_refs(dev)
        got = self.pool.match_prefix(hashes)
        assert got[: len(dev)] == dev and len(got) >= len(dev) + n
        new = got[len(dev) : len(dev) + n]
        evicted = max(0, n - free_before)
        assert new[n - evicted :] == self.lru[:evicted]
        del self.lru[:evicted]
        self._dropped_refs([*dev, *new][::-1])

    def _evicted_off_device(self, chosen: list[BlockHash] | None) -> int:
        on_host = set(self.pool.host_hashes())  # the host slots of the chosen hashes go too
        return len(on_host) if chosen is None else len(set(chosen) & on_host)

    @rule()
    def drain(self) -> None:
        for event in self.pool.drain_events():
            if isinstance(event, BlockStored):
                for child in event.block_hashes:
                    assert child not in self.indexed
                    self.indexed.add(child)
            elif isinstance(event, BlockRemoved):
                for gone in event.block_hashes:
                    self.indexed.remove(gone)
                    self.host_indexed.discard(gone)
            else:
                assert isinstance(event, BlockTiered)
                assert set(event.block_hashes) <= self.indexed
                if event.tier == "host":
                    self.host_indexed |= set(event.block_hashes)
                else:
                    self.host_indexed -= set(event.block_hashes)
        assert self.indexed == set(self.pool.held_hashes())
        assert self.host_indexed == set(self.pool.host_hashes())

    @invariant()
    def tier_copies_keep_the_bytes(self) -> None:
        for op in self.pool.take_copies():
            if op.to_host:
                self.host_data[op.slot] = self.dev_data.get(op.block_id)
            else:
                self.dev_data[op.block_id] = self.host_data.get(op.slot)
        host = self.pool.host
        assert host is not None
        for h in self.pool.held_hashes():
            if h in host:
                assert self.host_data.get(host._lru[h]) == h, "a host slot lost its block's bytes"
            else:
                (block,) = self.pool.match_prefix([h])
                assert self.dev_data.get(block) == h, "a device block lost its bytes"


TieredPoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestTieredBlockPoolStateful = TieredPoolMachine.TestCase
