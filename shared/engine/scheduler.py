"""Continuous batching over the block pool: chunked prefill under a token budget, prefix caching,
preemption by recompute, FCFS with priorities. Pure Python over plain data; it never touches a tensor.

Invariants (check_invariants() verifies them after any call):
- Every live request is in exactly one of `waiting` or `running`, both sorted by (priority, arrival,
  admission order); a finished request is in neither and holds no blocks.
- A running request holds ceil(num_computed_tokens / block_size) blocks, one reference each; a waiting
  request holds none, except one added by add_prefilled (its remotely filled blocks) before admission.
- A step schedules at most max_num_batched_tokens tokens and at most max_num_seqs requests run.
- Blocks [0, num_committed_blocks) of a request are committed (or duplicate a block the pool already
  holds under the same hash); commit happens in update(), once the step has written their KV.
- Blocks are released last-first (so the pool evicts chain tails first) on finish, abort and preemption.
- With `overlap`, a step's sampled tokens may reach update() after the next step was scheduled: a request
  that samples holds a placeholder (`num_pending`) from schedule() to update() (two while the next step is
  launched and this one not yet applied: at most one at each schedule()), the next step computes
  the placeholder's position (its input comes from the device), and num_computed_tokens may exceed
  num_tokens by the placeholder. A request whose placeholder would reach max_tokens, or whose sampling reads
  its history (penalties), is not scheduled again until update() has applied the token; nor is one whose
  placeholder finds no free block and would have to preempt itself (dropping its token, it would need the
  same block again after recomputing: a livelock in a full pool). A token sampled for a request that ended
  or was preempted meanwhile is dropped.
Threading: one caller (the engine loop) calls every method; aborts from other threads go through it.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pdserve.shared.engine.block_pool import BlockPool, NoFreeBlocks
from pdserve.shared.engine.prefix_heat import PrefixHeat
from pdserve.shared.engine.request import Request, RequestStatus
from pdserve.shared.types import BlockId, RequestId


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks + decode tokens)."""
    block_size: int = 16
    overlap: bool = False
    """Schedule the next step before this one's sampled tokens are applied (placeholders)."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is not accepted; it must be an int >= 1")


@dataclass(frozen=True)
class ScheduledRequest:
    """Tokens [start, start + num_new_tokens) of request.all_token_ids run this step."""

    request: Request
    start: int
    num_new_tokens: int
    samples: bool
    """The chunk reaches the end of the known tokens, so its last position yields the next token."""

    @property
    def placeholder(self) -> bool:
        """The step's only token is the previous step's sampled token, not yet applied (overlap). Read
        it before the previous step's update()."""
        return self.start == self.request.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledRequest, ...]
    """Batch order: running requests (priority order, decodes before prefill chunks), then admissions."""
    preempted_ids: tuple[RequestId, ...]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass
class SchedulerStats:
    """Cumulative token counters, as the engine exports them."""

    computed_tokens: int = 0
    """Every token scheduled for compute (prompt, recompute after preemption, decode)."""
    computed_prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    """Prompt tokens served from the prefix cache at admission."""
    preemptions: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, eos_token_ids: frozenset[int] = frozenset()):
        if pool.block_size != config.block_size:
            raise ValueError(f"pool block_size {pool.block_size} != scheduler block_size {config.block_size}")
        self.config = config
        self.pool = pool
        self.eos_token_ids = eos_token_ids
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[RequestId, Request] = {}
        self.stats = SchedulerStats()
        self.heat = PrefixHeat()
        """Hits per cached prefix chain (admission's matches here; the engine adds D's and exports')."""
        self._order: dict[RequestId, tuple[int, float, int]] = {}
        self._admitted = 0

    # ---- entry points -------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queues a request to prefill here; it may carry output tokens (a failover re-prefill)."""
        self._check_new(request)
        if request.block_ids or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id!r} holds blocks; use add_prefilled")
        self._enqueue(request)

    def add_prefilled(
        self, request: Request, block_ids: Sequence[BlockId], num_held_blocks: int, first_token: int
    ) -> None:
        """Takes a new request whose prompt KV sits in `block_ids` (one reference each, owned by the
        scheduler from now on) and the first output token, sampled where the prompt was computed. The
        first `num_held_blocks` blocks are committed blocks of this pool (a local prefix hit); the other
        full prompt blocks are committed here. It finishes at once if the first token ends it (EOS, a stop
        token, or max_tokens=1), releasing every block."""
        self._check_new(request)
        bs = self.config.block_size
        if request.block_ids or request.num_computed_tokens or request.output_token_ids:
            raise ValueError(f"request {request.request_id!r} is not new: it holds blocks or tokens")
        if len(block_ids) != -(-request.num_prompt_tokens // bs) or not 0 <= num_held_blocks <= len(
            block_ids
        ):
            raise ValueError(
                f"request {request.request_id!r}: {len(block_ids)} blocks ({num_held_blocks} held) for "
                f"{request.num_prompt_tokens} prompt tokens at block_size {bs}"
            )
        request.block_ids = list(block_ids)
        request.num_computed_tokens = request.num_prompt_tokens
        request.num_committed_blocks = num_held_blocks
        request.num_cached_tokens = min(num_held_blocks * bs, request.num_prompt_tokens)
        request.append_output([first_token], bs)
        self._enqueue(request)
        self._commit_full_blocks(request)
        self._check_stop(request, first_token)

    def abort(self, request_id: RequestId) -> Request | None:
        """Ends a live request on any path and frees what it holds; None if it is not live (idempotent)."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, RequestStatus.FINISHED_ABORTED, None)
        return request

    def finish(self, request_id: RequestId, stop_reason: int | str | None) -> Request | None:
        """Ends a request as stopped (a stop string the detokenizer found); None if it is not live."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, RequestStatus.FINISHED_STOPPED, stop_reason)
        return request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step -----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        planned: dict[RequestId, int] = {}  # request id -> tokens this step, in batch order
        preempted: list[RequestId] = []
        ready = [r for r in self.running if not self._awaits_update(r)]
        decodes = [r for r in ready if self._todo(r) == 1]
        chunks = [r for r in ready if self._todo(r) > 1]
        for request in decodes + chunks:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this step
                continue
            num_new = min(self._todo(request), budget)
            assert num_new > 0, f"running request {request.request_id!r} has no token to compute"
            while True:
                try:
                    request.block_ids += self.pool.allocate(self._blocks_short(request, num_new))
                except NoFreeBlocks:
                    victim = self.running[-1]
                    if victim is request and request.num_pending:
                        break  # its token is on the way: wait for update() rather than drop it
                    budget += planned.pop(victim.request_id, 0)
                    self._preempt(victim)
                    preempted.append(victim.request_id)
                    if victim is request:
                        break
                    continue
                planned[request.request_id] = num_new
                budget -= num_new
                break
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                head = self.waiting[0]
                num_new = self._admit(head, budget)
                if num_new:
                    planned[head.request_id] = num_new
                elif self.running or not self._preempt_waiting_holder(head, preempted):
                    break
                budget -= num_new
        return SchedulerOutput(tuple(self._advance(planned)), tuple(preempted))

    def update(self, output: SchedulerOutput, sampled_token_ids: Mapping[RequestId, int]) -> list[Request]:
        """Applies a step's result: commits blocks the step filled, appends the sampled token of every
        entry that samples, and finishes requests on EOS, a stop token or max_tokens. Returns the
        requests finished here. Entries whose request ended since schedule() are skipped."""
        finished: list[Request] = []
        for entry in output.scheduled:
            request = entry.request
            if request.status is not RequestStatus.RUNNING:
                continue
            self._commit_full_blocks(request, entry.start + entry.num_new_tokens)
            if not entry.samples:
                continue
            token = sampled_token_ids.get(request.request_id)
            if token is None:
                raise ValueError(f"no sampled token for request {request.request_id!r}, which sampled")
            if self.config.overlap:
                request.num_pending -= 1
            request.append_output([token], self.config.block_size)
            if self._check_stop(request, token):
                finished.append(request)
        return finished

    # ---- internals ----------------------------------------------------------------------------------
    def _check_new(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already live")
        if request.status is not RequestStatus.WAITING:
            raise ValueError(f"request {rid!r} has status {request.status.name}; new requests are WAITING")
        max_tokens = request.params.max_tokens
        if len(request.output_token_ids) >= max_tokens:
            raise ValueError(
                f"request {rid!r} already has {len(request.output_token_ids)} >= {max_tokens} tokens"
            )
        need = -(-(request.num_prompt_tokens + max_tokens - 1) // self.config.block_size)
        if need > self.pool.num_blocks:
            raise ValueError(
                f"request {rid!r}: prompt {request.num_prompt_tokens} + max_tokens {max_tokens} needs {need} "
                f"KV blocks, the pool has {self.pool.num_blocks}; shorten the prompt or max_tokens"
            )

    def _enqueue(self, request: Request) -> None:
        self._admitted += 1
        self._order[request.request_id] = (request.priority, request.arrival_time, self._admitted)
        self.requests[request.request_id] = request
        request.extend_block_hashes(self.config.block_size)
        bisect.insort(self.waiting, request, key=self._key)

    def _key(self, request: Request) -> tuple[int, float, int]:
        return self._order[request.request_id]

    @staticmethod
    def _todo(request: Request) -> int:
        """Tokens to compute before the request samples again (its placeholder included)."""
        return request.num_tokens + request.num_pending - request.num_computed_tokens

    @staticmethod
    def _awaits_update(request: Request) -> bool:
        """A placeholder the next step must not build on: it may be the last token, or sampling reads it."""
        if not request.num_pending:
            return False
        params = request.params
        return len(request.output_token_ids) + request.num_pending >= params.max_tokens or params.penalized

    def _blocks_short(self, request: Request, num_new: int) -> int:
        """Blocks to add so that tokens up to num_computed_tokens + num_new have slots."""
        return -(-(request.num_computed_tokens + num_new) // self.config.block_size) - len(request.block_ids)

    def _admit(self, request: Request, budget: int) -> int:
        """Moves the head of `waiting` to `running` with blocks for its first chunk; returns the chunk's
        token count, or 0 (nothing changed) when the pool cannot hold it now."""
        bs = self.config.block_size
        hits: list[BlockId] = []
        fresh = not request.block_ids
        if fresh:
            # Full blocks inside the first num_tokens - 1 tokens: at least one token is computed, so the
            # step produces the logits to sample from.
            hits = self.pool.match_prefix(request.block_hashes[: (request.num_tokens - 1) // bs])
            self.pool.acquire(hits)
            request.block_ids = list(hits)
            request.num_computed_tokens = len(hits) * bs
            request.num_committed_blocks = len(hits)
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        try:
            request.block_ids += self.pool.allocate(self._blocks_short(request, num_new))
        except NoFreeBlocks:
            if fresh:
                self._release_blocks(request)
            return 0
        if fresh:
            request.num_cached_tokens = len(hits) * bs
            self.stats.cached_prompt_tokens += min(len(hits) * bs, request.num_prompt_tokens)
            self.heat.hit(request.block_hashes, len(hits))
        self.waiting.pop(0)
        request.status = RequestStatus.RUNNING
        if request.scheduled_time is None:
            request.scheduled_time = time.monotonic()
        bisect.insort(self.running, request, key=self._key)
        return num_new

    def _advance(self, planned: dict[RequestId, int]) -> list[ScheduledRequest]:
        out: list[ScheduledRequest] = []
        for rid, num_new in planned.items():
            request = self.requests[rid]
            start = request.num_computed_tokens
            end = start + num_new
            samples = end == request.num_tokens + request.num_pending
            out.append(ScheduledRequest(request, start, num_new, samples))
            request.num_computed_tokens = end
            if samples and self.config.overlap:
                request.num_pending += 1
            self.stats.computed_tokens += num_new
            self.stats.computed_prompt_tokens += max(0, min(end, request.num_prompt_tokens) - start)
        return out

    def _commit_full_blocks(self, request: Request, written: int | None = None) -> None:
        """Commits the blocks full within the first `written` tokens (default: every computed token)."""
        upto = request.num_computed_tokens if written is None else written
        full = upto // self.config.block_size
        for i in range(request.num_committed_blocks, full):
            parent = request.block_hashes[i - 1] if i else None
            # A hash the pool already holds elsewhere returns that block; ours stays a private duplicate.
            tokens = request.all_token_ids[i * self.config.block_size : (i + 1) * self.config.block_size]
            self.pool.commit(request.block_ids[i], request.block_hashes[i], parent, tokens)
        request.num_committed_blocks = max(full, request.num_committed_blocks)

    def _check_stop(self, request: Request, token: int) -> bool:
        params = request.params
        if token in params.stop_token_ids:
            self._finish(request, RequestStatus.FINISHED_STOPPED, token)
        elif not params.ignore_eos and token in self.eos_token_ids:
            self._finish(request, RequestStatus.FINISHED_STOPPED, None)
        elif len(request.output_token_ids) >= params.max_tokens:
            self._finish(request, RequestStatus.FINISHED_LENGTH, None)
        return request.is_finished

    def _release_blocks(self, request: Request) -> None:
        blocks, request.block_ids = request.block_ids, []
        self.pool.release(blocks[::-1])
        request.num_pending = 0
        request.num_computed_tokens = 0
        request.num_committed_blocks = 0

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        # With overlap, the step in flight may have filled blocks update() has not committed yet: commit the
        # full ones of known tokens (their KV lands before any later step reads them, on the same stream), or
        # a request preempted for its next block would recompute them, need the block again, and livelock.
        self._commit_full_blocks(request, min(request.num_computed_tokens, request.num_tokens))
        self._release_blocks(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.stats.preemptions += 1
        bisect.insort(self.waiting, request, key=self._key)

    def _preempt_waiting_holder(self, head: Request, preempted: list[RequestId]) -> bool:
        """Nothing runs and the head cannot be admitted: the blocks must be held by waiting requests from
        add_prefilled. Turns the lowest-priority such holder (not the head) into a recompute request so
        the queue cannot deadlock; False when there is none."""
        for request in reversed(self.waiting):
            if request is not head and request.block_ids:
                self._release_blocks(request)
                request.status = RequestStatus.PREEMPTED
                request.num_preemptions += 1
                self.stats.preemptions += 1
                preempted.append(request.request_id)
                return True
        return False

    def _finish(self, request: Request, status: RequestStatus, stop_reason: int | str | None) -> None:
        queue = self.running if request in self.running else self.waiting
        queue.remove(request)
        self._release_blocks(request)
        request.status = status
        request.stop_reason = stop_reason
        del self.requests[request.request_id]
        del self._order[request.request_id]

    def check_invariants(self) -> None:
        bs = self.config.block_size
        live = self.waiting + self.running
        assert len(live) == len(self.requests) == len({id(r) for r in live}), "request lists out of sync"
        for queue in (self.waiting, self.running):
            keys = [self._key(r) for r in queue]
            assert keys == sorted(keys), "queue out of priority order"
        assert len(self.running) <= self.config.max_num_seqs
        for r in live:
            assert self.requests[r.request_id] is r
            assert r.all_token_ids == [*r.prompt_token_ids, *r.output_token_ids]
            assert len(r.block_hashes) == r.num_tokens // bs, f"{r.request_id}: block hashes not extended"
            assert r.num_computed_tokens <= r.num_tokens + r.num_pending
            assert r.num_pending in (0, 1, 2) and (r.num_pending == 0 or self.config.overlap)
            assert len(r.block_ids) == -(-r.num_computed_tokens // bs), f"{r.request_id}: block table size"
            assert r.num_committed_blocks <= r.num_computed_tokens // bs or not r.block_ids
            running = r.status is RequestStatus.RUNNING
            assert running == (r in self.running), f"{r.request_id}: status {r.status.name}"
            assert running or not r.block_ids or r.num_computed_tokens == r.num_prompt_tokens
