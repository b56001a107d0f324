"""The per-step broadcast from rank 0 to the other ranks: one packed message of the step's batch in a
shared memory region, and one byte down a pipe per worker ("doorbell") to say it is there.

Why shared memory and a doorbell rather than a torch.distributed broadcast: a worker waits for the next
step for as long as the engine is idle (hours on a quiet node), which a collective cannot do under a
timeout; the message's size varies with the batch (its block tables), which a broadcast's receivers must
know beforehand (a second broadcast, or a fixed maximum of ~100 KiB every step); and a pipe's end of file
tells a worker at once that rank 0 is gone. The region is a memfd, passed to the workers as a file
descriptor, so nothing is left in /dev/shm on any exit.

Message (int32, little-endian): [VERSION, n_items, n_tokens, n_table, argmax], then per item (start,
num_tokens, sample, n_blocks, prev_row), then the items' new token ids (a placeholder 0 for an item whose
token is the previous step's, still on the device: `prev_row` >= 0), then their block ids. Sampling parameters
do not travel: only rank 0 samples, over the logits gathered from every rank; with async scheduling it
broadcasts each step's sampled tokens on the device (`DistCollectives.broadcast_tokens`), which the workers'
next step reads for its placeholders. `argmax` = 1 marks a step whose rows are all plain greedy: every rank
ends it in the greedy tokens' all-gather (`ModelRunner.execute(argmax=True)`) instead of the logits' gather,
and every rank then holds its tokens, so none are broadcast.
Invariants: message n goes to slot n % SLOTS of the region; a worker copies a message out, then counts it
in its own counter after the slots, and rank 0 writes a slot only once every worker has counted the message
that slot held, so a slot is never read while it is rewritten (with async scheduling rank 0 runs a step
ahead of the workers; it waits only if they fall SLOTS messages behind, for at most the collective timeout).
"""

from __future__ import annotations

import mmap
import os
import time
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

from pdserve.shared.engine.model_runner import BatchItem
from pdserve.shared.engine.parallel.dist import COLLECTIVE_TIMEOUT_S, RankFailure

VERSION = 3
SLOTS = 4
_HEADER = 5
_PER_ITEM = 5
_COUNTER = 8  # bytes of a worker's consumed-message counter


def region_bytes(capacity: int, workers: int) -> int:
    """The shared region: SLOTS message slots of `capacity` bytes, then one counter per worker."""
    return SLOTS * capacity + _COUNTER * workers


def capacity_bytes(max_num_seqs: int, max_num_batched_tokens: int, max_blocks_per_seq: int) -> int:
    """The largest message a step of this engine can need."""
    ints = (
        _HEADER + max_num_seqs * (_PER_ITEM + max_blocks_per_seq) + max(max_num_batched_tokens, max_num_seqs)
    )
    return 4 * ints


@dataclass(frozen=True)
class StepMessage:
    """One step as a worker runs it."""

    items: list[BatchItem]
    argmax: bool
    """Every row of the step is plain greedy: the step returns tokens, on every rank."""


def pack(items: Sequence[BatchItem], argmax: bool = False) -> array[int]:
    head, tokens, table = array("i"), array("i"), array("i")
    for it in items:
        head.extend((it.start, it.num_tokens, int(it.sample), len(it.block_ids), it.prev_row))
        if it.prev_row >= 0:
            tokens.append(0)  # the worker reads it from the previous step's broadcast tokens
        else:
            tokens.extend(it.token_ids[it.start : it.start + it.num_tokens])
        table.extend(it.block_ids)
    msg = array("i", (VERSION, len(items), len(tokens), len(table), int(argmax)))
    msg.extend(head)
    msg.extend(tokens)
    msg.extend(table)
    return msg


def unpack(buf: bytes | memoryview) -> StepMessage:
    header = array("i", bytes(buf[: 4 * _HEADER]))
    version, n_items, n_tokens, n_table, argmax = header
    assert version == VERSION, f"step message version {version}, this rank reads {VERSION}"
    body = array("i", bytes(buf[4 * _HEADER : 4 * (_HEADER + _PER_ITEM * n_items + n_tokens + n_table)]))
    tok_at, table_at = _PER_ITEM * n_items, _PER_ITEM * n_items + n_tokens
    items = []
    for i in range(n_items):
        start, num, sample, n_blocks, prev_row = body[_PER_ITEM * i : _PER_ITEM * (i + 1)]
        new = body[tok_at : tok_at + num].tolist()
        blocks = body[table_at : table_at + n_blocks].tolist()
        tok_at, table_at = tok_at + num, table_at + n_blocks
        tail = _Tail(start, [] if prev_row >= 0 else new)
        items.append(BatchItem(tail, start, num, blocks, bool(sample), prev_row))
    return StepMessage(items, bool(argmax))


class _Tail(Sequence[int]):
    """A sequence's token ids from position `start` on: all a worker is sent (its earlier tokens' KV is in
    the cache already)."""

    def __init__(self, start: int, tokens: list[int]) -> None:
        self._start, self._tokens = start, tokens

    def __len__(self) -> int:
        return self._start + len(self._tokens)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            assert start >= self._start and step == 1, f"tokens before {self._start} were not sent"
            return self._tokens[start - self._start : stop - self._start]
        assert index >= self._start, f"token {index} is before {self._start}: not sent"
        return self._tokens[index - self._start]

    def __iter__(self) -> Iterator[int]:
        raise TypeError("a worker holds only the step's new tokens")


class StepWriter:
    """Rank 0's end: the region and one doorbell per worker. `fds(i)` are what worker i inherits."""

    def __init__(self, capacity: int, workers: int) -> None:
        self.capacity = capacity
        self.region_fd = os.memfd_create("pdserve-tp-step")
        size = region_bytes(capacity, workers)
        os.ftruncate(self.region_fd, size)
        self.region = mmap.mmap(self.region_fd, size)
        self.consumed = memoryview(self.region)[SLOTS * capacity :].cast("q")  # zero-filled: none yet
        self.bells = [os.pipe() for _ in range(workers)]  # (read end: the worker's, write end: ours)
        self.sent = 0

    def fds(self, worker: int) -> tuple[int, int]:
        """(region fd, doorbell read end) of worker `worker` (0-based among the workers)."""
        return self.region_fd, self.bells[worker][0]

    def started(self) -> None:
        """The workers hold their ends: ours of them are closed, so a worker's exit breaks its pipe."""
        for read_end, _ in self.bells:
            os.close(read_end)
        os.close(self.region_fd)

    def publish(self, items: Sequence[BatchItem], argmax: bool) -> None:
        data = pack(items, argmax).tobytes()
        if len(data) > self.capacity:
            raise ValueError(f"a step message of {len(data)} bytes exceeds the region's {self.capacity}")
        self._wait_for_slot()
        at = (self.sent % SLOTS) * self.capacity
        self.region[at : at + len(data)] = data
        self.sent += 1
        for rank, (_, write_end) in enumerate(self.bells, start=1):
            try:
                os.write(write_end, b"\x01")
            except BrokenPipeError as exc:
                raise RankFailure(f"tensor-parallel rank {rank} is gone; the engine is down") from exc

    def _wait_for_slot(self) -> None:
        """Until every worker has copied the message that the next slot held (SLOTS messages ago)."""
        need = self.sent - SLOTS + 1
        if need <= 0 or min(self.consumed) >= need:
            return
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
        while min(self.consumed) < need:
            if time.monotonic() > deadline:
                wait = f"{COLLECTIVE_TIMEOUT_S:.0f} s"
                raise RankFailure(f"tensor-parallel workers read no step for {wait}; the engine is down")
            time.sleep(0.0001)

    def close(self) -> None:
        """Closes the doorbells: every worker reads end of file and exits. Idempotent."""
        bells, self.bells = self.bells, []
        for _, write_end in bells:
            os.close(write_end)


class StepReader:
    """A worker's end."""

    def __init__(self, region_fd: int, bell_fd: int, capacity: int, worker: int, workers: int) -> None:
        """worker: this rank's index among the workers (rank - 1)."""
        self.region = mmap.mmap(region_fd, region_bytes(capacity, workers))
        os.close(region_fd)
        self.capacity = capacity
        self.consumed = memoryview(self.region)[SLOTS * capacity :].cast("q")
        self.worker = worker
        self.bell = bell_fd
        self.read = 0

    def receive(self) -> StepMessage | None:
        """The next step's batch, waiting as long as it takes; None once rank 0 has closed the channel
        (shut down or died)."""
        if not os.read(self.bell, 1):
            return None
        at = (self.read % SLOTS) * self.capacity
        step = unpack(memoryview(self.region)[at : at + self.capacity])
        self.read += 1
        self.consumed[self.worker] = self.read
        return step
