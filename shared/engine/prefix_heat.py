"""How hot each cached prefix chain of one node is: hits and the last hit's time per chain, for a drain that
moves the hottest prefixes to the nodes that will be asked for them (`kvctl drain --move-prefixes`); and the
blocks this node got by such a move, so that hits on them are counted.

A chain is the run of leading prompt blocks one hit matched, named by its last hash (hashes are chained: the
last one names the whole run). Invariants: at most `max_chains` chains are kept, the least recently hit
dropped first (32 bytes a block: 1,024 chains of 8k tokens are 16 MiB); recording a hit costs a dict lookup
(a join of its hashes the first time; and, only while moved blocks are held, a set lookup per matched
block); the moved set lists only hashes the node still holds (the engine forgets a hash when the pool
reports it Removed). What is tracked is an estimate for choosing what to move, never a correctness input: a
chain evicted since its last hit is trimmed to what the pool still holds when the chains are picked.
Threading: the engine thread only.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from pdserve.shared.types import BlockHash


@dataclass
class ChainHeat:
    joined: bytes
    """The chain's hashes, 32 bytes each, in one object (a chain of 512 blocks is one 16 KiB bytes, not
    512 objects of about 65 bytes each)."""
    hits: int
    last_hit: float
    """time.monotonic() of the last hit."""

    @property
    def hashes(self) -> tuple[BlockHash, ...]:
        j = self.joined
        return tuple(BlockHash(j[i : i + 32]) for i in range(0, len(j), 32))


@dataclass(frozen=True)
class HotChain:
    """A chain picked to move: its leading hashes the pool still holds, hits, seconds since its last hit."""

    hashes: tuple[BlockHash, ...]
    hits: int
    idle_s: float


class PrefixHeat:
    def __init__(self, max_chains: int = 1024) -> None:
        if max_chains < 1:
            raise ValueError(f"max_chains={max_chains} must be >= 1")
        self.max_chains = max_chains
        self._chains: OrderedDict[BlockHash, ChainHeat] = OrderedDict()  # least recently hit first
        self._moved: set[BlockHash] = set()
        self.moved_hit_blocks = 0
        """Blocks matched by hits that this node got by a move (cumulative)."""

    def hit(self, hashes: Sequence[BlockHash], n: int) -> None:
        """A prompt (or a fetcher) matched the leading `n` of `hashes` here."""
        if n <= 0:
            return
        tail = hashes[n - 1]
        chain = self._chains.get(tail)
        now = time.monotonic()
        if chain is None:
            self._chains[tail] = ChainHeat(b"".join(hashes[:n]), 1, now)
            if len(self._chains) > self.max_chains:
                self._chains.popitem(last=False)
        else:
            chain.hits += 1
            chain.last_hit = now
            self._chains.move_to_end(tail)
        if self._moved:
            self.moved_hit_blocks += sum(1 for h in hashes[:n] if h in self._moved)

    def mark_moved(self, hashes: Iterable[BlockHash]) -> None:
        """These blocks came by a move: later hits on them count in `moved_hit_blocks`."""
        self._moved.update(hashes)

    def forget(self, hashes: Iterable[BlockHash]) -> None:
        """These hashes left the node."""
        if self._moved:
            self._moved.difference_update(hashes)

    @property
    def moved_blocks(self) -> int:
        return len(self._moved)

    def hottest(self, held: Callable[[Sequence[BlockHash]], int], budget_blocks: int) -> list[HotChain]:
        """The chains to move, hottest first (more hits, then the more recent), each trimmed to the leading
        blocks the pool still holds (`held` counts them), until `budget_blocks` distinct blocks are taken: a
        chain that does not fit whole is cut to fit; blocks shared with a chain taken before are not counted
        twice."""
        now = time.monotonic()
        order = sorted(self._chains.values(), key=lambda c: (c.hits, c.last_hit), reverse=True)
        taken: set[BlockHash] = set()
        out: list[HotChain] = []
        for chain in order:
            room = budget_blocks - len(taken)
            if room <= 0:
                break
            hashes = chain.hashes
            hashes = hashes[: held(hashes)]
            new = [i for i, h in enumerate(hashes) if h not in taken]
            if not new:
                continue
            if len(new) > room:
                hashes = hashes[: new[room - 1] + 1]
            taken.update(hashes)
            out.append(HotChain(hashes, chain.hits, now - chain.last_hit))
        return out
