"""The bookkeeping of the host-memory KV tier: a fixed number of host slots, each holding one evicted
device block's KV under its hash, in LRU order. Pure Python over slot numbers; the bytes live in a host
tensor the engine owns (pinned on CUDA, plain memory on the CPU build) and are moved by the copies the
block pool queues (block_pool.CopyOp).

Invariants (check_invariants() verifies them):
- every slot is free, holds exactly one hash, or is taken by a restore in progress; `_lru` (oldest
  first) maps exactly the used slots;
- a hash is held at most once; capacity never changes; `put` into a full tier first drops the LRU entry.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pdserve.shared.types import BlockHash


class HostTier:
    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots ({num_slots}) must be positive")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._lru: OrderedDict[BlockHash, int] = OrderedDict()

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def hashes(self) -> list[BlockHash]:
        return list(self._lru)

    def leading(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """The longest prefix of `hashes` held here."""
        out: list[BlockHash] = []
        for h in hashes:
            if h not in self._lru:
                break
            out.append(h)
        return out

    def put(self, block_hash: BlockHash) -> tuple[int | None, BlockHash | None]:
        """A slot for `block_hash` (which must not be here) and the hash dropped to make room, if any; no slot
        when every slot is taken (a restore in progress holds them)."""
        assert block_hash not in self._lru, f"hash {block_hash.hex()} is in the host tier already"
        dropped = None
        if not self._free:
            if not self._lru:
                return None, None
            dropped, slot = self._lru.popitem(last=False)
            self._free.append(slot)
        slot = self._free.pop()
        self._lru[block_hash] = slot
        return slot, dropped

    def take(self, block_hash: BlockHash) -> int:
        """Removes `block_hash`; its slot stays out of the free list until `free(slot)`."""
        return self._lru.pop(block_hash)

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def give_back(self, block_hash: BlockHash, slot: int) -> None:
        """Puts a taken hash back in its slot, as the most recently used."""
        self._lru[block_hash] = slot

    def check_invariants(self, taken: int = 0) -> None:
        """`taken`: slots taken and not freed yet (none between pool calls)."""
        used = set(self._lru.values())
        free = set(self._free)
        assert len(used) == len(self._lru), "host tier: a slot holds two hashes"
        assert len(free) == len(self._free) and not used & free, "host tier: a slot is free and used"
        assert len(used) + len(free) + taken == self.num_slots, "host tier: slots lost"
