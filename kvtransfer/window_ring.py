"""Where cuda_ipc's payloads land in D's window: the placement both ends compute alike, so no offset travels.

Invariants: offsets are ALIGN-aligned and a payload never crosses the window's end; `must` names the newest
earlier frame whose bytes (or event slot: at most SLOTS frames in flight) the new frame reuses, which must
be released before it is written. Pure Python: tested on the CPU (tests/test_kvtransfer_cuda_ipc.py).
"""

from __future__ import annotations

import collections

SLOTS = 32  # frames that may be in flight per connection (one "copied" and one "freed" event each)
ALIGN = 512  # window offsets are multiples of this


class WindowRing:
    """Where each payload of a connection lands in D's window: the next ALIGN-aligned offset, wrapping to 0
    when the payload does not fit before the end. Both ends place the same sizes in the same order, so they
    agree on every offset."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._next = 0
        self._seq = 0
        # frames placed since the last one known released on the GPU: (seq, start, end), oldest first
        self._live: collections.deque[tuple[int, int, int]] = collections.deque()
        self._saved: tuple[int, int, list[tuple[int, int, int]]] | None = None

    def place(self, nbytes: int) -> tuple[int, int, int]:
        """(seq, offset, must) of the next payload: `must` is the newest earlier frame that has to be
        released before this one is written (it overwrites that frame's bytes, or reuses its event slot),
        or -1."""
        if not 0 < nbytes <= self.capacity:
            raise ValueError(f"a {nbytes} B payload does not fit the cuda_ipc window of {self.capacity} B")
        self._saved = (self._next, self._seq, list(self._live))
        start = self._next if self._next + nbytes <= self.capacity else 0
        end = start + nbytes
        seq = self._seq
        must = max(seq - SLOTS, -1)
        for other, lo, hi in self._live:
            if lo < end and start < hi:
                must = max(must, other)
        while self._live and self._live[0][0] <= must:
            self._live.popleft()
        self._live.append((seq, start, end))
        self._next = -(-end // ALIGN) * ALIGN
        self._seq = seq + 1
        return seq, start, must

    def undo(self) -> None:
        """Forget the last `place` (its frame is not sent after all)."""
        assert self._saved is not None, "undo without a place"
        self._next, self._seq, live = self._saved
        self._live = collections.deque(live)
        self._saved = None
