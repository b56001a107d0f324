"""KV block bookkeeping for one node: refcounts, free list, LRU of cached blocks, hash map, reservations.

Pure Python over block ids; the KV tensor lives in the model runner. Each block is in exactly one state:
  FREE      ref 0, no hash, in the free list (never used, or freed before it was hashed, or evicted)
  CACHED    ref 0, hashed, in the LRU (head = next to evict); matchable and reusable by hash
  IN_USE    ref > 0, not reserved, hashed or not
  RESERVED  ref 1, no hash: blocks a remote fill writes into; not matchable, not committable
Invariants (check_invariants() verifies every one):
- free list + LRU + IN_USE + RESERVED partition the blocks; only ref-0 blocks are in a list, each in one.
- Both lists are intrusive doubly-linked lists through the blocks (prev/next, sentinel heads); only the
  list helpers touch prev/next, and moving a block between lists allocates nothing.
- A RESERVED block has ref 1 and no hash.
- A hash is written once per block life (a second write is an AssertionError) and cleared only by
  eviction; the hash map holds exactly the hashed blocks, one block per hash.
- Allocation takes FREE blocks first, then evicts from the LRU head; a failed allocation changes nothing.
- Releasing a sequence's blocks in REVERSE order puts its chain tail nearest the LRU head, so tails are
  evicted before the prefixes other requests can still match.
- Every hash entering or leaving the map is reported once, in order, by drain_events() (drain it every
  step: events accumulate until drained).
With a host tier (`host_blocks` > 0, shared/engine/host_tier.py):
- A hash is in at most one tier: the device map or the host tier. A CACHED block the pool evicts moves its
  hash to the host tier (the tier's LRU entry is dropped when it is full) and queues a copy out; `restore`
  moves hashes back into fresh device blocks and queues copies in; committing a hash the host tier holds
  takes it out of the tier. The queued CopyOps must run, in order, before anything writes the device blocks
  they read (take_copies() after every call that allocates or restores).
- The events describe the node's holdings over both tiers: Stored/Removed when a hash enters/leaves the
  node, BlockTiered when it moves between tiers; `held_hashes()` lists both tiers.
Why one module of about 420 lines: every state change of a block (both tiers, the events, the lists) is
checked against the invariants above by one check_invariants() and one property test; splitting the tier's
moves out would put half of each transition in another file.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from pdserve.shared.engine.host_tier import HostTier
from pdserve.shared.types import BlockHash, BlockId


@dataclass(frozen=True)
class BlockStored:
    """Blocks that became matchable; each hash's parent is the one before it, the first's is parent_hash.
    token_ids: the blocks' tokens, block_size per block, when every committer of the batch gave them, else
    () (a prefix fetched from another node arrives as hashes only)."""

    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class BlockTiered:
    """Hashes the node still holds that moved to `tier` ("host": evicted from the device pool into the host
    tier; "device": brought back or recomputed)."""

    block_hashes: tuple[BlockHash, ...]
    tier: Literal["device", "host"]


BlockEvent = BlockStored | BlockRemoved | BlockTiered


@dataclass(frozen=True)
class CopyOp:
    """One block's KV to move: device block `block_id` -> host slot `slot` (to_host), or back."""

    to_host: bool
    block_id: BlockId
    slot: int


class NoFreeBlocks(Exception):
    """Fewer allocatable blocks than asked for; the pool is unchanged."""


@dataclass(frozen=True)
class PoolAudit:
    """Block counts by state (free + cached + in_use + reserved == num_blocks)."""

    num_blocks: int
    free: int
    cached: int
    in_use: int
    reserved: int
    host: int = 0
    """Hashes held in the host tier (not counted in num_blocks)."""


class _Block:
    __slots__ = ("block_hash", "block_id", "next", "prev", "ref", "reserved")

    def __init__(self, block_id: int) -> None:
        self.block_id = BlockId(block_id)
        self.ref = 0
        self.reserved = False
        self.block_hash: BlockHash | None = None
        self.prev: _Block | None = None
        self.next: _Block | None = None


class _List:
    """Intrusive doubly-linked list of blocks between two sentinels; O(1) append/remove/pop."""

    def __init__(self) -> None:
        self.head = _Block(-1)
        self.tail = _Block(-1)
        self.head.next, self.tail.prev = self.tail, self.head
        self.size = 0

    def append(self, block: _Block) -> None:
        last = self.tail.prev
        assert last is not None
        block.prev, block.next = last, self.tail
        last.next = self.tail.prev = block
        self.size += 1

    def remove(self, block: _Block) -> None:
        prev, nxt = block.prev, block.next
        assert prev is not None and nxt is not None, f"block {block.block_id} is in no list"
        prev.next, nxt.prev = nxt, prev
        block.prev = block.next = None
        self.size -= 1

    def first(self) -> _Block:
        block = self.head.next
        assert block is not None and block is not self.tail
        return block

    def __iter__(self) -> Iterator[_Block]:
        block = self.head.next
        while block is not None and block is not self.tail:
            yield block
            block = block.next


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int = 16, host_blocks: int = 0) -> None:
        if num_blocks <= 0 or block_size <= 0 or host_blocks < 0:
            raise ValueError(
                f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive, "
                f"host_blocks ({host_blocks}) >= 0"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free = _List()
        self._lru = _List()
        for block in self._blocks:
            self._free.append(block)
        self._by_hash: dict[BlockHash, _Block] = {}
        # Pending events as (kind, hashes, parent, token ids of Stored blocks or None: some committer gave
        # none), kind S(tored) R(emoved) H(ost) D(evice); batches grow in place, frozen by drain_events.
        self._events: list[tuple[str, list[BlockHash], BlockHash | None, list[int] | None]] = []
        self._num_reserved = 0
        self.host = HostTier(host_blocks) if host_blocks else None
        self._copies: list[CopyOp] = []

    def num_free(self) -> int:
        """Blocks allocatable now: FREE plus evictable CACHED."""
        return self._free.size + self._lru.size

    def match_prefix(self, hashes: Sequence[BlockHash]) -> list[BlockId]:
        """Blocks of the longest prefix of hashes held here (IN_USE or CACHED); takes no reference."""
        out: list[BlockId] = []
        for block_hash in hashes:
            block = self._by_hash.get(block_hash)
            if block is None:
                break
            out.append(block.block_id)
        return out

    def acquire(self, block_ids: Sequence[BlockId]) -> None:
        """One more reference each (a CACHED block leaves the LRU); call right after match_prefix."""
        blocks = self._shareable(block_ids)
        for block in blocks:
            self._ref(block)

    def allocate(self, n: int) -> list[BlockId]:
        """n unhashed blocks with ref 1: FREE ones first, then LRU evictions (BlockRemoved)."""
        return [b.block_id for b in self._take(n)]

    def reserve(self, n: int) -> list[BlockId]:
        """Like allocate, for a remote fill: RESERVED until fill_done; aborting is release."""
        blocks = self._take(n)
        for block in blocks:
            block.reserved = True
        self._num_reserved += n
        return [b.block_id for b in blocks]

    def fill_done(self, block_ids: Sequence[BlockId]) -> None:
        blocks = [self._get(i) for i in block_ids]
        if len(set(block_ids)) != len(blocks):
            raise ValueError(f"block ids repeat in {list(block_ids)}")
        for block in blocks:
            if not block.reserved:
                raise ValueError(f"block {block.block_id} is {self._state(block)}, not reserved")
        for block in blocks:
            block.reserved = False
        self._num_reserved -= len(blocks)

    def commit(
        self,
        block_id: BlockId,
        block_hash: BlockHash,
        parent_hash: BlockHash | None,
        token_ids: Sequence[int] | None = None,
    ) -> BlockId:
        """The block's KV is complete: hash it and make it shareable (BlockStored, with `token_ids`, the
        block's tokens, when given). If another block holds the hash already, this one stays unhashed and the
        holder's id is returned."""
        block = self._get(block_id)
        if block.ref == 0 or block.reserved:
            raise ValueError(f"block {block_id} is {self._state(block)}; only in-use blocks can be committed")
        if block.block_hash is not None:
            raise AssertionError(f"block {block_id} already has hash {block.block_hash.hex()}")
        if not isinstance(block_hash, bytes) or len(block_hash) != 32:
            raise ValueError(f"block_hash must be 32 bytes, got {block_hash!r}")
        existing = self._by_hash.get(block_hash)
        if existing is not None:
            return existing.block_id
        block.block_hash = block_hash
        self._by_hash[block_hash] = block
        if self.host is not None and block_hash in self.host:  # recomputed: the host copy is stale weight
            self.host.free(self.host.take(block_hash))
            self._event("D", block_hash)
            return block_id
        last = self._events[-1] if self._events else None
        if last is not None and last[0] == "S" and parent_hash is not None and last[1][-1] == parent_hash:
            last[1].append(block_hash)
            if last[3] is not None and token_ids is not None:
                last[3].extend(token_ids)
            elif last[3] is not None:
                self._events[-1] = (*last[:3], None)
        else:
            self._events.append(
                ("S", [block_hash], parent_hash, None if token_ids is None else list(token_ids))
            )
        return block_id

    def release(self, block_ids: Sequence[BlockId]) -> None:
        """Drop one reference per id. Release a sequence's blocks last-first (see the module invariants)."""
        blocks = [self._get(i) for i in block_ids]
        for block_id, count in Counter(block_ids).items():
            block = self._blocks[block_id]
            if block.ref < count:
                raise ValueError(f"block {block_id} has {block.ref} references, asked to release {count}")
        for block in blocks:
            self._unref(block)

    def evict(self, hashes: Sequence[BlockHash] | None = None) -> int:
        """Drop cached-free blocks and host-tier entries from this node (all of them when hashes is None);
        returns how many were dropped. Nothing moves to the host tier: the operator asked them gone."""
        host = self.host
        if hashes is None:
            victims = list(self._lru)
            gone = [] if host is None else host.hashes()
        else:
            found = (self._by_hash.get(h) for h in dict.fromkeys(hashes))
            victims = [b for b in found if b is not None and b.ref == 0]
            gone = [] if host is None else [h for h in dict.fromkeys(hashes) if h in host]
        for block in victims:
            self._lru.remove(block)
            self._drop_hash(block, offload=False)
            self._free.append(block)
        for h in gone:
            assert host is not None
            host.free(host.take(h))
            self._event("R", h)
        return len(victims) + len(gone)

    def restore(self, hashes: Sequence[BlockHash]) -> int:
        """Brings the run of `hashes` that follows the device-held prefix back from the host tier into fresh
        device blocks (copies in queued; blocks committed and CACHED, most recently used), as many as the
        pool can take; returns how many came back."""
        host = self.host
        if host is None:
            return 0
        dev = self.match_prefix(hashes)
        run = host.leading(hashes[len(dev) :])
        if not run:
            return 0
        self.acquire(dev)  # the allocation below must not evict the prefix it continues
        slots = [host.take(h) for h in run]
        n = min(len(run), self.num_free())
        blocks = self._take(n)  # may move other blocks to the host tier: their copies queue first
        for h, slot in zip(run[n:], slots[n:], strict=True):
            host.give_back(h, slot)
        for h, slot, block in zip(run, slots, blocks, strict=False):
            self._copies.append(CopyOp(False, block.block_id, slot))
            host.free(slot)  # a later copy out into it is queued after this copy in
            block.block_hash = h
            self._by_hash[h] = block
            self._event("D", h)
        self.release([*dev, *(b.block_id for b in blocks)][::-1])
        return n

    def take_copies(self) -> list[CopyOp]:
        """The queued tier copies, in the order they must run; run them before the next forward or fill."""
        copies, self._copies = self._copies, []
        return copies

    def held_hashes(self) -> list[BlockHash]:
        """Every hash held here (IN_USE, CACHED, or in the host tier), for the index digest."""
        return list(self._by_hash) + ([] if self.host is None else self.host.hashes())

    def host_hashes(self) -> list[BlockHash]:
        return [] if self.host is None else self.host.hashes()

    def drain_events(self) -> list[BlockEvent]:
        events, self._events = self._events, []
        out: list[BlockEvent] = []
        for kind, hashes, parent, tokens in events:
            if kind == "S":
                out.append(BlockStored(tuple(hashes), parent, tuple(tokens or ())))
            elif kind == "R":
                out.append(BlockRemoved(tuple(hashes)))
            else:
                out.append(BlockTiered(tuple(hashes), "host" if kind == "H" else "device"))
        return out

    def audit(self) -> PoolAudit:
        free, cached = self._free.size, self._lru.size
        in_use = self.num_blocks - free - cached - self._num_reserved
        host = 0 if self.host is None else len(self.host)
        return PoolAudit(self.num_blocks, free, cached, in_use, self._num_reserved, host)

    def check_invariants(self) -> None:
        """Verify every invariant of the module docstring; AssertionError names the first broken one."""
        listed: set[int] = set()
        for lst, hashed in ((self._free, False), (self._lru, True)):
            count, prev = 0, lst.head
            for b in lst:
                name = f"block {b.block_id} in the {'LRU' if hashed else 'free list'}"
                _require(b.prev is prev and b.block_id not in listed, f"{name}: broken link or in two lists")
                _require(b.ref == 0 and not b.reserved, f"{name}: ref {b.ref}")
                _require((b.block_hash is not None) == hashed, f"{name}: hash {b.block_hash!r}")
                listed.add(b.block_id)
                count, prev = count + 1, b
            _require(lst.tail.prev is prev and count == lst.size, f"list size {lst.size}, walked {count}")
        for b in self._blocks:
            name = f"block {b.block_id}"
            _require(b.block_id in listed or (b.ref > 0 and b.prev is b.next is None), f"{name}: lost")
            _require(not b.reserved or (b.ref == 1 and b.block_hash is None), f"{name}: RESERVED")
            _require(b.block_hash is None or self._by_hash.get(b.block_hash) is b, f"{name}: not in map")
        num_hashed = sum(b.block_hash is not None for b in self._blocks)
        _require(num_hashed == len(self._by_hash), f"map has {len(self._by_hash)}, blocks {num_hashed}")
        _require(self._num_reserved == sum(b.reserved for b in self._blocks), "reserved counter drifted")
        if self.host is not None:
            self.host.check_invariants()
            both = [h for h in self.host.hashes() if h in self._by_hash]
            _require(not both, f"{len(both)} hashes in both tiers")

    def _shareable(self, block_ids: Sequence[BlockId]) -> list[_Block]:
        blocks = [self._get(i) for i in block_ids]
        for b in blocks:
            if b.reserved or (b.ref == 0 and b.block_hash is None):
                raise ValueError(f"block {b.block_id} is {self._state(b)}; only IN_USE or CACHED blocks")
        return blocks

    def _get(self, block_id: BlockId) -> _Block:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is outside [0, {self.num_blocks})")
        return self._blocks[block_id]

    @staticmethod
    def _state(block: _Block) -> str:
        if block.reserved:
            return "RESERVED"
        if block.ref > 0:
            return "IN_USE"
        return "FREE" if block.block_hash is None else "CACHED"

    def _take(self, n: int) -> list[_Block]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free():
            raise NoFreeBlocks(f"need {n} blocks, {self.num_free()} allocatable of {self.num_blocks}")
        out: list[_Block] = []
        for _ in range(n):
            lst = self._free if self._free.size else self._lru
            block = lst.first()
            lst.remove(block)
            if block.block_hash is not None:
                self._drop_hash(block)
            block.ref = 1
            out.append(block)
        return out

    def _drop_hash(self, block: _Block, offload: bool = True) -> None:
        """The block's hash leaves the device map: into the host tier (a copy out queued) when there is one
        and `offload`, else off this node."""
        h = block.block_hash
        assert h is not None
        del self._by_hash[h]
        block.block_hash = None
        if self.host is None or not offload:
            self._event("R", h)
            return
        slot, dropped = self.host.put(h)
        if dropped is not None:
            self._event("R", dropped)
        if slot is None:  # every slot is being restored from: this one leaves the node
            self._event("R", h)
            return
        self._copies.append(CopyOp(True, block.block_id, slot))
        self._event("H", h)

    def _event(self, kind: str, block_hash: BlockHash) -> None:
        """Appends to the last batch when it is of the same kind (Stored batches go through commit)."""
        if self._events and self._events[-1][0] == kind and kind != "S":
            self._events[-1][1].append(block_hash)
        else:
            self._events.append((kind, [block_hash], None, None))

    def _ref(self, block: _Block) -> None:
        if block.ref == 0:
            self._lru.remove(block)
        block.ref += 1

    def _unref(self, block: _Block) -> None:
        block.ref -= 1
        if block.ref == 0:
            if block.reserved:  # an aborted reservation: never hashed, back to the free list
                block.reserved = False
                self._num_reserved -= 1
            (self._free if block.block_hash is None else self._lru).append(block)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(f"block pool invariant: {message}")
