"""The synchronous engine: scheduler + model runner + sampler + detokenizers, one `step()` at a time.

Invariants: the engine is driven by one thread (the async wrapper's loop); every request added is ended
exactly once (finished, stopped or aborted) and its blocks go back to the pool on that path; outputs of a
step are produced only after the scheduler has applied the step. A role (prefill, decode, single) is a
policy around this class, never a fork of it, and reaches it only through its public methods (never its
pool, scheduler, runner or a `Request`'s fields): the prefill role watches layers through `StepObserver`
(which sees each scheduled request as a `StepSlice`) and copies them out with `export_layer`; the decode
role uses the remote-KV port (`reserve_remote` -> `import_layers`* -> `admit_remote` | `release_remote`);
the node runtime reads `snapshot`, `held_hashes`, `num_requests` and `audit`, and calls `evict`; a drain
that moves prefixes reads `hot_prefixes` on the draining node and calls `mark_moved` on the receiving one.
A prefix fetch uses the same port on both ends: the holder pins its blocks (`hold_prefix` ...
`release_held`) while it exports them, and the fetcher checks `cached_prefix_blocks`, reserves, imports,
then `commit_fetched` makes the landed blocks matchable under their hashes while the reservation still
holds them, until `release_remote` leaves them CACHED.

Overlap (`EngineConfig.async_scheduling`): at most one step is in flight across `step()` calls. A call
schedules and launches the next step (its placeholder tokens read from the in-flight step's sampled tokens
on the device), then waits for the in-flight step, applies its tokens to the scheduler and emits its outputs
(detokenization and stop strings run while the device computes the step just launched). Outputs therefore
come one call late; `has_unfinished()` stays true while a step is in flight. A block handed to another
writer (`reserve_remote`) is never one an in-flight step still writes: the reservation waits for it.

Remote-KV port invariants: a `RemoteReservation` holds one reference on each of its blocks until exactly
one of `admit_remote` (the scheduler takes them over) or `release_remote` (idempotent) ends it; its
`held` blocks are committed blocks of this pool matching the prompt's leading hashes (never the last
prompt block, so the sender always sends at least the final token's KV) and are never written; its
`dst` blocks are RESERVED (not matchable) until admission. Export and import move blocks in the model's
full KV-head layout, every rank's heads (parallel/kv_pools.py), so a frame is the same at any TP size.

Structured output: a request with a constraint holds a grammar `Matcher` (shared/engine/grammar.py) from
`_track` until its `_Live` entry is dropped (finish or abort: nothing else to release). At every launch its
matcher is brought to the request's output tokens (on D the first token P sampled is replayed this way) and
the batch's bitmask is filled in one call while the step's forward runs on the device; the sampler applies it
on the device. With overlap, a constrained row's previous token is still on the device at launch: the host
waits for the previous step's sampled tokens (queued before the forward just launched, so the device never
idles for it) and the mask is built under this step's forward.

Why one module of about 600 lines: the step loop and the ports (remote KV, prefix fetch, what the node
runtime reads) keep the same invariants over the same pool and in-flight step (a reserved or held block is
never one an in-flight step writes), so they are read and changed together; the pool, scheduler, runner and
sampler they glue are their own modules.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from pdserve.shared.engine.block_hash import hash_seed, model_fingerprint
from pdserve.shared.engine.block_pool import BlockEvent, BlockPool, BlockRemoved, PoolAudit
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.detokenizer import IncrementalDetokenizer
from pdserve.shared.engine.grammar import Grammars, Matcher
from pdserve.shared.engine.host_copy import HostTierCopier
from pdserve.shared.engine.model_runner import BatchItem, ModelRunner, kv_bytes_per_block, size_kv_pool
from pdserve.shared.engine.parallel.kv_pools import KVPools, RankPool
from pdserve.shared.engine.parallel.ranks import start_ranks
from pdserve.shared.engine.prefix_heat import HotChain
from pdserve.shared.engine.request import Request, RequestStatus
from pdserve.shared.engine.sampler import PendingSample, Sampler, SamplingState
from pdserve.shared.engine.sampling_params import SamplingParams
from pdserve.shared.engine.scheduler import ScheduledRequest, Scheduler, SchedulerConfig, SchedulerOutput
from pdserve.shared.model import fp8
from pdserve.shared.model.loader import LoadedModel, ModelLoadError, load_config, load_model
from pdserve.shared.model.parallel import check_split, plan
from pdserve.shared.node.node_protocol import StepOutput, TokenLogprob, TopLogprob
from pdserve.shared.types import BlockHash, BlockId, FinishReason, FirstToken, KVLayout, RequestId

log = logging.getLogger(__name__)

_RESTORE_AHEAD = 8
"""Waiting requests whose prefixes each step brings back from the host tier before scheduling."""


@dataclass(frozen=True)
class StepSlice:
    """One request's part of a step as an observer sees it: tokens [start, start + num_new_tokens) of its
    prompt and output run this step, into `blocks` (the request's block ids so far, in prompt order)."""

    request_id: RequestId
    start: int
    num_new_tokens: int
    num_prompt_tokens: int
    blocks: tuple[BlockId, ...]


class StepObserver(Protocol):
    def on_layer(self, layer: int, scheduled: Sequence[StepSlice]) -> None:
        """Layer `layer` has written its KV for every scheduled request of this step."""


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine counts read together on the engine thread. Token counts are cumulative since start-up."""

    running: int = 0
    waiting: int = 0
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0
    queued_prefill_tokens: int = 0
    """Tokens not computed yet over the engine's requests: the prompts left to prefill, plus one per decoding
    request (as the heartbeat's NodeLoad counts them for the router); the prefill HPA's signal."""
    preemptions: int = 0
    computed_prompt_tokens: int = 0
    computed_tokens: int = 0
    cached_prompt_tokens: int = 0
    host_blocks: int = 0
    """Blocks held in the host-memory tier (shared/engine/host_tier.py)."""
    host_offloaded_blocks: int = 0
    host_restored_blocks: int = 0
    moved_hit_blocks: int = 0
    """Blocks matched by prefix hits that came here by a drain's move (shared/engine/prefix_heat.py)."""

    @property
    def kv_usage(self) -> float:
        """KV blocks in use or reserved over the pool, a float from 0 to 1."""
        return self.kv_used_blocks / self.kv_total_blocks if self.kv_total_blocks else 0.0


@dataclass
class _Live:
    request: Request
    detok: IncrementalDetokenizer
    emitted: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    grammar: Matcher | None = None


@dataclass(frozen=True)
class _InFlight:
    """A launched step whose tokens the scheduler has not applied yet."""

    out: SchedulerOutput
    sampling: tuple[ScheduledRequest, ...]
    sample: PendingSample
    rows: dict[RequestId, int]
    """Row of each sampling request's token in sample.tokens."""


@dataclass
class RemoteReservation:
    """Blocks for a prompt whose KV another node computes: `held` prefix blocks this pool already has,
    then `dst` blocks the transfer writes. `live` is False once admitted or released; `slot`: it holds
    one of the engine's max_num_seqs places until then (a decode OPEN's, reserved with headroom)."""

    held: tuple[BlockId, ...]
    dst: tuple[BlockId, ...]
    live: bool = True
    slot: bool = False

    @property
    def block_ids(self) -> list[BlockId]:
        return [*self.held, *self.dst]


class LLMEngine:
    def __init__(self, cfg: EngineConfig, loaded: LoadedModel | None = None) -> None:
        """`loaded`: a model already loaded (tests, benchmarks), at tensor-parallel size 1 only."""
        self.cfg = cfg
        self.bind_thread()
        assert loaded is None or cfg.tensor_parallel_size == 1, (
            "a tensor-parallel engine loads its own shares"
        )
        mc = loaded.config if loaded is not None else load_config(cfg.model)
        self.max_model_len = min(cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        try:
            check_split(mc, cfg.tensor_parallel_size)  # before any rank starts
        except ValueError as exc:
            raise ModelLoadError(f"cannot load model from {cfg.model}: {exc}") from exc
        if cfg.kv_cache_dtype == "fp8" and cfg.torch_device.type == "cuda":  # the CPU reads it in torch
            reason = fp8.unsupported_reason(cfg.torch_device)
            if reason is not None:
                raise ModelLoadError(f"--kv-cache-dtype fp8 on {cfg.device}: {reason}")
        # rank 0 (this process) schedules, samples and owns the block pool; the others run its steps
        self.ranks = start_ranks(cfg, self.max_model_len)
        try:
            self.loaded = loaded or load_model(
                cfg.model,
                device=cfg.torch_device,
                dtype=cfg.torch_dtype,
                tokenizer_path=cfg.tokenizer,
                seed=cfg.seed,
                comm=self.ranks.comm,
                quantization=cfg.quantization,
            )
            self.ranks.join()
            self.num_blocks = self.ranks.agree_min(
                cfg.num_kv_blocks or size_kv_pool(cfg, self.loaded, self.max_model_len)
            )
        except BaseException:
            self.ranks.close()
            raise
        self.tokenizer = self.loaded.tokenizer
        if cfg.chat_template is not None:  # before anything reads the tokenizer's fingerprint
            self.tokenizer.chat_template = cfg.chat_template
        # a host-tier slot holds a whole block, every KV head of the model (a rank's pool holds its share)
        per_block = (
            kv_bytes_per_block(self.loaded, cfg) * mc.num_kv_heads // self.loaded.model.tp.num_kv_heads
        )
        self.host_blocks = cfg.host_kv_cache_bytes // per_block
        self.block_bytes = per_block
        """KV bytes of one block, every layer and KV head: what moving a block moves."""
        self.pool = BlockPool(self.num_blocks, cfg.block_size, self.host_blocks)
        self.eos_token_ids = frozenset(mc.eos_token_ids) | self.tokenizer.eos_token_ids
        self.scheduler = Scheduler(
            SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.block_size, cfg.overlap),
            self.pool,
            self.eos_token_ids,
        )
        self.runner = ModelRunner(self.loaded, cfg, self.num_blocks, max_model_len=self.max_model_len)
        # every rank's pool, reached from here: the remote-KV port and the host tier move whole blocks
        try:
            others = self.ranks.open_pools(tuple(self.runner.kv_cache.shape), self.runner.kv_cache.dtype)
        except BaseException:
            self.close()
            raise
        size = cfg.tensor_parallel_size
        self.pools = KVPools(
            [
                RankPool(kv, plan(mc, rank, size).kv_head_start)
                for rank, kv in enumerate([self.runner.kv_cache, *others])
            ],
            mc.num_kv_heads,
            self.runner.ops,
        )
        self.tier = HostTierCopier(self.pools, self.host_blocks) if self.host_blocks else None
        self.sampler = Sampler(eos_token_ids=self.eos_token_ids)
        self.grammars = Grammars(self.tokenizer, mc.vocab_size, pinned=cfg.torch_device.type == "cuda")
        self.fingerprint = model_fingerprint(
            mc.to_dict(), self.loaded.weights_identity, cfg.kv_dtype_name, cfg.block_size
        )
        self.observer: StepObserver | None = None
        self._live: dict[RequestId, _Live] = {}
        self._seeds: dict[str | None, BlockHash] = {}
        self._inflight: _InFlight | None = None
        self._slots_reserved = 0
        """Live reservations holding a max_num_seqs place (`RemoteReservation.slot`)."""

    def bind_thread(self) -> None:
        """Makes this engine's GPU the calling thread's current device (torch's current device is per thread,
        and Triton launches on it): called at construction and by the thread that runs the step loop."""
        if self.cfg.torch_device.type == "cuda":
            torch.cuda.set_device(self.cfg.torch_device)

    def close(self) -> None:
        """Releases what the runner captured (CUDA graphs and their pool) and stops the other tensor-parallel
        ranks; the engine must not step after."""
        self.runner.close()
        self.ranks.close()

    def on_rank_failure(self, callback: Callable[[str], None]) -> None:
        """Calls `callback(why)` once, from another thread, when a tensor-parallel rank of this engine dies
        (the engine is down: its next step raises); never at size 1."""
        self.ranks.on_failure(callback)

    def hash_seed(self, cache_salt: str | None) -> BlockHash:
        seed = self._seeds.get(cache_salt)
        if seed is None:
            seed = self._seeds[cache_salt] = hash_seed(self.fingerprint, cache_salt)
        return seed

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raises ValueError naming the problem for a request this engine cannot serve."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty; at least one token is needed")
        vocab = self.loaded.config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds the model's context of {self.max_model_len} tokens"
            )
        need = -(-(total - 1) // self.cfg.block_size)
        if need > self.num_blocks:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) needs {need} KV "
                f"blocks; this node's pool has {self.num_blocks}"
            )
        if params.constraint is not None:
            self.grammars.compile(params.constraint)  # GrammarError (a ValueError) names the problem

    def new_request(
        self,
        request_id: RequestId,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> Request:
        self.validate(prompt_token_ids, params)
        return Request(request_id, tuple(prompt_token_ids), params, self.hash_seed(cache_salt), priority)

    def prompt_hashes(self, request: Request) -> tuple[BlockHash, ...]:
        """The chained hashes of the prompt's full blocks, computed once and kept on the request (so a
        request admitted later through `admit_remote` is not hashed on the path to its first token). Any
        thread, before the request enters the engine."""
        request.extend_block_hashes(self.cfg.block_size)
        return tuple(request.block_hashes)

    def add_request(self, request: Request) -> None:
        self.scheduler.add(request)
        self._track(request)

    # ---- the remote-KV port (engine thread only) -----------------------------------------------------
    def reserve_remote(
        self, block_hashes: Sequence[BlockHash], num_blocks: int, headroom: bool = False
    ) -> RemoteReservation | None:
        """Reserves a prompt of `num_blocks` blocks: its longest held prefix (not the last block) plus fresh
        blocks for the rest; None when the pool cannot take it now. With `headroom`, also None while a
        local request waits for blocks, unless one free block per live request remains afterwards, and
        while max_num_seqs requests are live here: admitting remote work never starves the decodes already
        running, and work this node could not start waits at its transfer (its TTFT), not after its first
        token in the engine's queue."""
        if self._inflight is not None:
            self._inflight.sample.wait()  # a block freed meanwhile may still be written by that step
        pool, sched = self.pool, self.scheduler
        self._restore(block_hashes[: max(0, num_blocks - 1)])
        held = pool.match_prefix(block_hashes[: max(0, num_blocks - 1)])
        pool.acquire(held)
        self.scheduler.heat.hit(block_hashes, len(held))
        spare = pool.num_free() - (num_blocks - len(held))
        if headroom and spare >= 0:
            live = len(sched.running) + len(sched.waiting) + self._slots_reserved
            starved = any(not r.block_ids for r in sched.waiting)
            if starved or spare < live or live >= self.cfg.max_num_seqs:
                spare = -1
        if spare < 0:
            pool.release(held[::-1])
            return None
        dst = tuple(pool.reserve(num_blocks - len(held)))
        reservation = RemoteReservation(tuple(held), dst, slot=headroom)
        self._slots_reserved += headroom
        self._run_copies()  # blocks the reservation evicted go to the host tier before the fill lands
        return reservation

    def hold_prefix(self, block_hashes: Sequence[BlockHash]) -> tuple[BlockId, ...]:
        """Pins the longest prefix of `block_hashes` this pool holds (one reference each) so that an export
        can read it while steps run; end with `release_held`. Fewer than asked when the index was stale."""
        self._restore(block_hashes)
        held = self.pool.match_prefix(block_hashes)
        self.pool.acquire(held)
        self.scheduler.heat.hit(block_hashes, len(held))  # another node's hit on this node's cache
        return tuple(held)

    def cached_prefix_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading `block_hashes` the device pool holds now (no reference taken)."""
        return len(self.pool.match_prefix(block_hashes))

    def release_held(self, block_ids: Sequence[BlockId]) -> None:
        """Drops the references `hold_prefix` took (last-first, as every sequence is released)."""
        self.pool.release(list(block_ids)[::-1])

    def commit_fetched(self, reservation: RemoteReservation, block_hashes: Sequence[BlockHash]) -> None:
        """Every `dst` block of a live reservation has its KV (a fetched prefix whose leading hashes are
        `block_hashes`): they leave RESERVED and are committed under their hashes, so a request admitted
        next matches them. The reservation keeps its references until `release_remote`; a hash the pool
        got meanwhile from elsewhere leaves our copy an unhashed duplicate that goes back to the free list."""
        if not reservation.live:
            raise ValueError("the fetch's reservation was already ended")
        first = len(reservation.held)
        if len(block_hashes) < first + len(reservation.dst):
            raise ValueError(f"{len(block_hashes)} hashes for {first + len(reservation.dst)} fetched blocks")
        self.pool.fill_done(reservation.dst)
        for i, block in enumerate(reservation.dst, start=first):
            self.pool.commit(block, block_hashes[i], block_hashes[i - 1] if i else None)

    def import_layers(self, layer_start: int, dst_block_ids: torch.Tensor, buffer: torch.Tensor) -> None:
        """Scatters a frame into reserved blocks of every rank. buffer: [n_layers, 2, n, B, H, D] (or one
        layer without the leading dim; H: every KV head of the model), on the host or already on the cache's
        device; queued on the current stream."""
        self.pools.scatter_layers(
            layer_start, dst_block_ids, buffer if buffer.dim() == 6 else buffer.unsqueeze(0)
        )

    def export_layer(self, layer: int, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Copies `layer`'s KV of `block_ids` (on the cache's device), every rank's heads, into out
        [2, n, B, H, D]."""
        self.pools.gather(layer, block_ids, out)

    def export_buffer(self, n_layers: int, n_blocks: int) -> torch.Tensor:
        """An empty [n_layers, 2, n_blocks, B, H, D] buffer on the cache's device for export_layer."""
        p = self.pools
        return torch.empty((n_layers, 2, n_blocks, *p.block_shape), dtype=p.dtype, device=p.device)

    @property
    def devices(self) -> tuple[str, ...]:
        """Each tensor-parallel rank's device, rank 0 first."""
        return tuple(str(self.cfg.rank_device(r)) for r in range(self.cfg.tensor_parallel_size))

    @property
    def num_layers(self) -> int:
        return self.pools.num_layers

    @property
    def kv_layout(self) -> KVLayout:
        """The KV layout a node registers and the transfer handshake compares: the model's (every KV head,
        as export and import move them), and how many ranks hold it here."""
        c = self.loaded.config
        return KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, self.cfg.block_size, self.cfg.kv_dtype_name,
                        self.cfg.tensor_parallel_size)  # fmt: skip

    def admit_remote(
        self,
        request: Request,
        reservation: RemoteReservation,
        first: FirstToken,
    ) -> StepOutput:
        """Enters a request whose prompt KV has landed in `reservation` with the first token sampled where it
        was computed (its logprob is kept when the request asked for logprobs); returns that token's output
        (finished at once when it ends the request)."""
        if not reservation.live:
            raise ValueError(f"request {request.request_id!r}: its reservation was already ended")
        reservation.live = False
        self._slots_reserved -= reservation.slot
        blocks = reservation.block_ids
        self.pool.fill_done(reservation.dst)
        try:
            self.scheduler.add_prefilled(request, blocks, len(reservation.held), first.token_id)
        except BaseException:
            self.pool.release(blocks[::-1])
            raise
        live = self._track(request)
        if first.logprob is not None:
            live.logprobs.append(self._logprob(first.token_id, first.logprob, first.top))
        return self._emit(live)

    def release_remote(self, reservation: RemoteReservation) -> None:
        """Gives a reservation's blocks back; a no-op once admitted or released."""
        if reservation.live:
            reservation.live = False
            self._slots_reserved -= reservation.slot
            self.pool.release(reservation.block_ids[::-1])

    def _track(self, request: Request) -> _Live:
        constraint = request.params.constraint
        live = _Live(
            request,
            IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, request.params),
            grammar=None if constraint is None else self.grammars.matcher(constraint),
        )
        self._live[request.request_id] = live
        return live

    def abort(self, request_id: RequestId) -> StepOutput | None:
        live = self._live.pop(request_id, None)
        self.scheduler.abort(request_id)
        if live is None:
            return None
        return self._output(live, (), "", "abort")

    def movable_requests(self) -> list[tuple[RequestId, tuple[BlockHash, ...]]]:
        """The live requests a drain may move to another node (node/drain_migrate.py), with the hashes of
        their committed blocks (prompt and generated tokens): those decoding (a token sampled), without
        frequency or presence penalties (they count output tokens only) and unconstrained (a grammar's state
        would start over), as the router's migration takes them (router/migration.py)."""
        moving = []
        for rid, live in self._live.items():
            r, p = live.request, live.request.params
            penalties = p.frequency_penalty or p.presence_penalty
            if r.output_token_ids and not penalties and p.constraint is None:
                moving.append((rid, tuple(r.block_hashes[: r.num_committed_blocks])))
        return moving

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def _restore(self, block_hashes: Sequence[BlockHash]) -> None:
        """Brings a prefix's blocks back from the host tier (after the part the device holds) and runs the
        copies; a no-op without a tier."""
        if self.tier is not None and self.pool.restore(block_hashes):
            self._run_copies()

    def _run_copies(self) -> None:
        if self.tier is not None:
            self.tier.run(self.pool.take_copies())

    def _restore_waiting(self) -> None:
        """The prefixes of the requests about to be admitted come back from the host tier, so admission
        matches them as cached (blocks restored and evicted again before then are computed: never wrong)."""
        sched, bs = self.scheduler, self.cfg.block_size
        room = self.cfg.max_num_seqs - len(sched.running)
        for request in sched.waiting[: max(0, min(room, _RESTORE_AHEAD))]:
            if not request.block_ids:
                self.pool.restore(request.block_hashes[: (request.num_tokens - 1) // bs])

    def step(self) -> list[StepOutput]:
        """Runs one step. Without overlap: schedule, compute, sample, and return its outputs. With overlap:
        launch the next step, then return the outputs of the one launched by the previous call."""
        prev, self._inflight = self._inflight, None
        if self.tier is not None:
            self._restore_waiting()
        out = self.scheduler.schedule()
        # before the launch writes blocks the schedule evicted or restored (an in-flight step's writes are
        # ordered before the copies on the device's stream)
        self._run_copies()
        launched = self._launch(out, prev) if out.scheduled else None
        if not self.cfg.overlap:
            prev, launched = launched, None
        self._inflight = launched
        return [] if prev is None else self._apply(prev)

    def _launch(self, out: SchedulerOutput, prev: _InFlight | None) -> _InFlight:
        items = []
        for s in out.scheduled:
            row = -1
            if prev is not None and s.placeholder:
                row = prev.rows[s.request.request_id]
            items.append(
                BatchItem(
                    s.request.all_token_ids, s.start, s.num_new_tokens, s.request.block_ids, s.samples, row
                )
            )
        observer, hook = self.observer, None
        if observer is not None:
            slices = tuple(
                StepSlice(
                    s.request.request_id,
                    s.start,
                    s.num_new_tokens,
                    s.request.num_prompt_tokens,
                    tuple(s.request.block_ids),
                )
                for s in out.scheduled
            )

            def hook(layer: int) -> None:
                observer.on_layer(layer, slices)

        sampling = tuple(s for s in out.scheduled if s.samples)
        states = [
            SamplingState(
                params=s.request.params,
                prompt_token_ids=s.request.prompt_token_ids,
                output_token_ids=s.request.output_token_ids,
                position=s.start + s.num_new_tokens,
            )
            for s in sampling
        ]
        # across ranks, a greedy step moves each rank's best per row, not the whole vocabulary's logits
        argmax = self.ranks.comm.size > 1 and self.sampler.argmax_suffices(states)
        self.ranks.publish(items, argmax)
        result = self.runner.execute(
            items,
            hook,
            prev_tokens=None if prev is None else prev.sample.tokens,
            wait=not self.cfg.overlap,
            argmax=argmax,
        )
        rows = {s.request.request_id: i for i, s in enumerate(sampling)}
        if argmax:  # every rank holds the tokens: nothing to share
            sample = self.sampler.chosen(result)
        else:
            sample = self.sampler.launch(result, states, self._grammar_masks(sampling, prev))
            if self.cfg.overlap and sampling:
                self.ranks.share_tokens(sample.tokens)  # the other ranks' next step reads its placeholders
        return _InFlight(out, sampling, sample, rows)

    def _grammar_masks(
        self, sampling: Sequence[ScheduledRequest], prev: _InFlight | None
    ) -> torch.Tensor | None:
        """The grammar bitmask of a step's sampling rows ([S, ceil(V / 32)] on the host), None when no row is
        constrained. A placeholder row's previous token comes from the step in flight (a wait for its sampled
        tokens, which the device produced before this step's forward)."""
        matchers: list[Matcher | None] = []
        pending: tuple[int, ...] | None = None
        for s in sampling:
            live = self._live.get(s.request.request_id)
            matcher = None if live is None else live.grammar
            if matcher is not None:
                output: Sequence[int] = s.request.output_token_ids
                if s.placeholder and prev is not None:
                    if pending is None:
                        pending = prev.sample.result().token_ids
                    output = [*output, pending[prev.rows[s.request.request_id]]]
                matcher.advance_to(output)
            matchers.append(matcher)
        if all(m is None for m in matchers):
            return None
        return self.grammars.fill_masks(matchers)

    def _apply(self, step: _InFlight) -> list[StepOutput]:
        """Waits for a launched step's tokens, applies them, and emits the outputs of its live requests."""
        result = step.sample.result()
        tokens: dict[RequestId, int] = {}
        emit: list[_Live] = []
        for s, tok, lp, top in zip(
            step.sampling, result.token_ids, result.logprobs, result.top_logprobs, strict=True
        ):
            live = self._live.get(s.request.request_id)
            if live is None or live.request is not s.request or s.request.status is not RequestStatus.RUNNING:
                continue  # ended or preempted since: its token is dropped
            tokens[s.request.request_id] = tok
            emit.append(live)
            if lp is not None:
                live.logprobs.append(self._logprob(tok, lp, top or ()))
        self.scheduler.update(step.out, tokens)
        return [self._emit(live) for live in emit]

    def _logprob(self, token_id: int, logprob: float, top: Sequence[tuple[int, float]]) -> TokenLogprob:
        """A sampled token's logprob and its top alternatives, each token with its text and UTF-8 bytes."""

        def piece(tid: int) -> tuple[str, tuple[int, ...]]:
            text = self.tokenizer.decode([tid], skip_special_tokens=False)
            return text, tuple(text.encode("utf-8"))

        text, raw = piece(token_id)
        alternatives = []
        for tid, value in top:
            top_text, top_raw = piece(tid)
            alternatives.append(TopLogprob(top_text, tid, value, top_raw))
        return TokenLogprob(token_id, text, logprob, raw, tuple(alternatives))

    def _emit(self, live: _Live) -> StepOutput:
        request = live.request
        new = tuple(request.output_token_ids[live.emitted :])
        live.emitted = len(request.output_token_ids)
        text = live.detok.add(new)
        reason = request.finish_reason
        if reason is None and live.detok.finished:
            self.scheduler.finish(request.request_id, live.detok.stop_reason)
            reason = "stop"
        if reason is not None:
            text += live.detok.flush()
            del self._live[request.request_id]
        return self._output(live, new, text, reason)

    def _output(
        self, live: _Live, new: tuple[int, ...], text: str, reason: FinishReason | None
    ) -> StepOutput:
        r = live.request
        lps = None
        if r.params.logprobs is not None:
            lps = tuple(live.logprobs[len(live.logprobs) - len(new) :]) if new else ()
        return StepOutput(
            r.request_id,
            new,
            text,
            lps,
            reason,
            r.num_prompt_tokens,
            len(r.output_token_ids),
            r.num_cached_tokens,
            arrival_time=r.arrival_time,
            scheduled_time=r.scheduled_time,
        )

    def drain_events(self) -> list[BlockEvent]:
        events = self.pool.drain_events()
        heat = self.scheduler.heat
        if heat.moved_blocks:
            for event in events:
                if isinstance(event, BlockRemoved):
                    heat.forget(event.block_hashes)
        return events

    def hot_prefixes(self, budget_blocks: int) -> list[HotChain]:
        """The hottest cached prefix chains, up to `budget_blocks` distinct blocks the device pool holds
        (shared/engine/prefix_heat.py): what a drain moves to other nodes."""
        return self.scheduler.heat.hottest(self.cached_prefix_blocks, budget_blocks)

    def mark_moved(self, block_hashes: Sequence[BlockHash]) -> None:
        """These blocks arrived by a drain's move (a committed fetch): hits on them are counted."""
        self.scheduler.heat.mark_moved(block_hashes)

    # ---- what the node runtime reads (engine thread only) ----------------------------------------------
    def snapshot(self) -> EngineSnapshot:
        """The engine's counts, read together."""
        s, audit = self.scheduler, self.pool.audit()
        return EngineSnapshot(
            running=len(s.running),
            waiting=len(s.waiting),
            kv_used_blocks=audit.in_use + audit.reserved,
            kv_total_blocks=audit.num_blocks,
            queued_prefill_tokens=sum(
                r.num_tokens + r.num_pending - r.num_computed_tokens for r in [*s.waiting, *s.running]
            ),
            preemptions=s.stats.preemptions,
            computed_prompt_tokens=s.stats.computed_prompt_tokens,
            computed_tokens=s.stats.computed_tokens,
            cached_prompt_tokens=s.stats.cached_prompt_tokens,
            host_blocks=audit.host,
            host_offloaded_blocks=0 if self.tier is None else self.tier.offloaded,
            host_restored_blocks=0 if self.tier is None else self.tier.restored,
            moved_hit_blocks=s.heat.moved_hit_blocks,
        )

    def held_hashes(self) -> list[BlockHash]:
        """The hashes of every full block the node holds (in use, cached-free, or in the host tier): what
        the index lists."""
        return self.pool.held_hashes()

    def host_hashes(self) -> list[BlockHash]:
        """The held hashes that sit in the host tier (the index's host list)."""
        return self.pool.host_hashes()

    def evict(self, hashes: Sequence[BlockHash] | None) -> int:
        """Drops these cached-free blocks and host-tier entries (None: all of them) from this node; returns
        how many."""
        return self.pool.evict(hashes)

    def grammar_matchers(self) -> int:
        """Grammar matchers live requests hold (0 once every constrained request has ended)."""
        return sum(live.grammar is not None for live in self._live.values())

    def num_requests(self) -> int:
        """Requests the scheduler holds (waiting, running or preempted)."""
        return len(self.scheduler.requests)

    def audit(self) -> PoolAudit:
        self.pool.check_invariants()
        return self.pool.audit()
