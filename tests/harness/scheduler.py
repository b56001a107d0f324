"""The scheduler tests' harness: the Scheduler over the real BlockPool, no model; a fake step writes token ids
into a simulated KV store so every scenario also checks that cached and preserved blocks hold the tokens
they claim to hold."""

from __future__ import annotations

import itertools

from pdserve.shared.engine.block_hash import hash_seed
from pdserve.shared.engine.block_pool import BlockPool
from pdserve.shared.engine.request import Request, RequestStatus
from pdserve.shared.engine.sampling_params import SamplingParams
from pdserve.shared.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pdserve.shared.types import RequestId

SEED = hash_seed(bytes(32), None)
EOS = 2


class Harness:
    """Scheduler + pool + a KV store of (block, offset) -> token id written by each step. With `overlap`, a
    step is scheduled (and writes its KV) before the previous step's tokens are applied, as the engine's
    async scheduling does; a placeholder position gets the token the previous step sampled."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 4,
        max_num_seqs: int = 8,
        budget: int = 64,
        overlap: bool = False,
    ):
        self.pool = BlockPool(num_blocks, block_size)
        config = SchedulerConfig(max_num_seqs, budget, block_size, overlap)
        self.sched = Scheduler(config, self.pool, frozenset({EOS}))
        self.kv: dict[tuple[int, int], int] = {}
        self.clock = itertools.count()
        self.inflight: tuple[SchedulerOutput, dict[RequestId, int]] | None = None

    def request(
        self, rid: str, prompt: list[int], max_tokens: int = 4, priority: int = 0, **kw: object
    ) -> Request:
        params = SamplingParams(max_tokens=max_tokens, **kw)  # type: ignore[arg-type]
        return Request(RequestId(rid), tuple(prompt), params, SEED, priority, float(next(self.clock)))

    def add(self, *args: object, **kw: object) -> Request:
        req = self.request(*args, **kw)  # type: ignore[arg-type]
        self.sched.add(req)
        return req

    def step(self, token_of: dict[str, int] | None = None) -> tuple[SchedulerOutput, list[Request]]:
        """Schedules and runs one step; returns it and the requests finished by the step applied now (this
        one, or with `overlap` the previous one)."""
        prev, self.inflight = self.inflight, None
        out = self.sched.schedule()
        bs = self.pool.block_size
        assert out.num_batched_tokens <= self.sched.config.max_num_batched_tokens
        assert len(self.sched.running) <= self.sched.config.max_num_seqs
        sampled: dict[RequestId, int] = {}
        for s in out.scheduled:
            r = s.request
            assert len(r.block_ids) * bs >= s.start + s.num_new_tokens
            for pos in range(s.start):  # everything before the chunk must already be in the KV
                assert self.kv[(r.block_ids[pos // bs], pos % bs)] == r.all_token_ids[pos], (
                    r.request_id,
                    pos,
                )
            for pos in range(s.start, s.start + s.num_new_tokens):
                if pos < r.num_tokens:
                    token = r.all_token_ids[pos]
                else:  # the placeholder: the previous step sampled it, not applied yet
                    assert prev is not None and pos == r.num_tokens, (r.request_id, pos)
                    token = prev[1][r.request_id]
                self.kv[(r.block_ids[pos // bs], pos % bs)] = token
            if s.samples:
                default = 100 + len(r.output_token_ids) + max(0, r.num_pending - 1)
                sampled[r.request_id] = (token_of or {}).get(r.request_id, default)
        if self.sched.config.overlap:
            self.inflight = (out, sampled) if out.scheduled else None
            finished = self._apply(prev) if prev is not None else []
        else:
            finished = self.sched.update(out, sampled)
        self.check()
        return out, finished

    def _apply(self, step: tuple[SchedulerOutput, dict[RequestId, int]]) -> list[Request]:
        out, sampled = step
        live = {s.request.request_id for s in out.scheduled if s.request.status is RequestStatus.RUNNING}
        return self.sched.update(out, {rid: t for rid, t in sampled.items() if rid in live})

    def has_work(self) -> bool:
        return self.sched.has_unfinished() or self.inflight is not None

    def run(self, limit: int = 1000) -> list[str]:
        """Steps until idle; returns request ids in finishing order."""
        order: list[str] = []
        for _ in range(limit):
            if not self.has_work():
                return order
            order += [r.request_id for r in self.step()[1]]
        raise AssertionError("scheduler did not drain")

    def check(self) -> None:
        self.pool.check_invariants()
        self.sched.check_invariants()
        held = {b for r in self.sched.requests.values() for b in r.block_ids}
        assert self.pool.audit().in_use == len(held)

    def assert_all_free(self) -> None:
        audit = self.pool.audit()
        assert audit.in_use == audit.reserved == 0
        assert audit.free + audit.cached == audit.num_blocks
