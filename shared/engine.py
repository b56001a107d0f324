"""The synchronous engine: scheduler + model runner + sampler + detokenizers, one `step()` at a time.

Invariants: the engine is driven by one thread (the async wrapper's loop); every request added is ended
exactly once (finished, stopped or aborted) and its blocks go back to the pool on that path; outputs of a
step are produced only after the scheduler has applied the step. A role (prefill, decode, single) is a
policy around this class, never a fork of it: the prefill role watches layers through `StepObserver`,
the decode role enters remotely filled requests through `add_prefilled`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from pdserve.kernels.ops import get_ops
from pdserve.shared.block_hash import hash_seed, model_fingerprint
from pdserve.shared.block_pool import BlockEvent, BlockPool, PoolAudit
from pdserve.shared.config import EngineConfig
from pdserve.shared.cuda_graphs import plan_gpu_memory
from pdserve.shared.detokenizer import IncrementalDetokenizer
from pdserve.shared.loader import LoadedModel, load_model
from pdserve.shared.model_runner import BatchItem, ModelRunner, kv_bytes_per_block
from pdserve.shared.request import Request
from pdserve.shared.sampler import Sampler, SamplingState
from pdserve.shared.sampling_params import SamplingParams
from pdserve.shared.scheduler import ScheduledRequest, Scheduler, SchedulerConfig, SchedulerOutput
from pdserve.shared.types import BlockHash, BlockId, RequestId

log = logging.getLogger(__name__)


class StepObserver(Protocol):
    def on_layer(self, layer: int, scheduled: Sequence[ScheduledRequest]) -> None:
        """Layer `layer` has written its KV for every scheduled request of this step."""

    def on_step_done(self, scheduled: Sequence[ScheduledRequest]) -> None:
        """The step's forward has run to the end (its KV is complete in the cache)."""


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request. `text` is the new text since the previous output."""

    request_id: RequestId
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Live:
    request: Request
    detok: IncrementalDetokenizer
    emitted: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)


class LLMEngine:
    def __init__(self, cfg: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.cfg = cfg
        self.bind_thread()
        self.loaded = loaded or load_model(
            cfg.model,
            device=cfg.torch_device,
            dtype=cfg.torch_dtype,
            tokenizer_path=cfg.tokenizer,
            seed=cfg.seed,
        )
        mc = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = min(cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.num_blocks = cfg.num_kv_blocks or self._size_pool()
        self.pool = BlockPool(self.num_blocks, cfg.block_size)
        self.eos_token_ids = frozenset(mc.eos_token_ids) | self.tokenizer.eos_token_ids
        self.scheduler = Scheduler(
            SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.block_size),
            self.pool,
            self.eos_token_ids,
        )
        self.runner = ModelRunner(self.loaded, cfg, self.num_blocks, max_model_len=self.max_model_len)
        self.sampler = Sampler()
        self.fingerprint = model_fingerprint(
            mc.to_dict(), self.loaded.weights_identity, cfg.dtype_name, cfg.block_size
        )
        self.observer: StepObserver | None = None
        self._live: dict[RequestId, _Live] = {}
        self._seeds: dict[str | None, BlockHash] = {}

    def bind_thread(self) -> None:
        """Makes this engine's GPU the calling thread's current device (torch's current device is per thread,
        and Triton launches on it): called at construction and by the thread that runs the step loop."""
        if self.cfg.torch_device.type == "cuda":
            torch.cuda.set_device(self.cfg.torch_device)

    def _size_pool(self) -> int:
        cfg = self.cfg
        per_block = kv_bytes_per_block(self.loaded, cfg)
        if cfg.torch_device.type == "cuda":
            # after the weights, before the pool and the graphs: measure activations, reserve for capture
            plan = plan_gpu_memory(
                self.loaded.model,
                get_ops(cfg.torch_device),
                block_size=cfg.block_size,
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                utilization=cfg.gpu_memory_utilization,
                cuda_graphs=cfg.cuda_graphs,
            )
            n = max(2, plan.num_blocks(per_block))
            log.info(
                "KV pool: %d blocks = %d tokens (%.2f GiB); GPU %.1f GiB, used %.2f GiB, activations "
                "%.2f GiB, graph reserve %.2f GiB, sampler reserve %.2f GiB",
                n, n * cfg.block_size, n * per_block / 2**30, plan.total / 2**30, plan.used_before_kv / 2**30,
                plan.activation_peak / 2**30, plan.graph_reserve / 2**30, plan.sampler_reserve / 2**30,
            )  # fmt: skip
            return n
        n = max(2, cfg.kv_cache_bytes // per_block)
        log.info("KV pool: %d blocks = %d tokens (%.2f GiB)", n, n * cfg.block_size, n * per_block / 2**30)
        return n

    def close(self) -> None:
        """Releases what the runner captured (CUDA graphs and their pool); the engine must not step after."""
        self.runner.close()

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

    def add_request(self, request: Request) -> None:
        self.scheduler.add(request)
        self._track(request)

    def add_prefilled(self, request: Request, first_logprob: TokenLogprob | None = None) -> RequestOutput:
        """Enters a request whose prompt KV arrived from a prefill node; returns the first token's output."""
        self.scheduler.add_prefilled(request)
        live = self._track(request)
        if first_logprob is not None:
            live.logprobs.append(first_logprob)
        return self._emit(live)

    def _track(self, request: Request) -> _Live:
        live = _Live(
            request, IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, request.params)
        )
        self._live[request.request_id] = live
        return live

    def abort(self, request_id: RequestId) -> RequestOutput | None:
        live = self._live.pop(request_id, None)
        self.scheduler.abort(request_id)
        if live is None:
            return None
        return self._output(live, (), "", "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        logits = self._forward(out)
        sampling = [s for s in out.scheduled if s.samples]
        states = [
            SamplingState(
                params=s.request.params,
                prompt_token_ids=s.request.prompt_token_ids,
                output_token_ids=s.request.output_token_ids,
                position=s.request.num_tokens,
            )
            for s in sampling
        ]
        result = self.sampler.sample(logits, states)
        tokens = dict(zip((s.request.request_id for s in sampling), result.token_ids, strict=True))
        for s, tok, lp, top in zip(
            sampling, result.token_ids, result.logprobs, result.top_logprobs, strict=True
        ):
            if lp is not None:
                self._live[s.request.request_id].logprobs.append(TokenLogprob(tok, lp, top or ()))
        self.scheduler.update(out, tokens)
        return [self._emit(self._live[s.request.request_id]) for s in sampling]

    def _forward(self, out: SchedulerOutput) -> torch.Tensor:
        items = [
            BatchItem(s.request.all_token_ids, s.start, s.num_new_tokens, s.request.block_ids, s.samples)
            for s in out.scheduled
        ]
        observer = self.observer
        hook = None if observer is None else (lambda layer: observer.on_layer(layer, out.scheduled))
        logits = self.runner.execute(items, hook)
        if observer is not None:
            observer.on_step_done(out.scheduled)
        return logits

    def _emit(self, live: _Live) -> RequestOutput:
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

    def _output(self, live: _Live, new: tuple[int, ...], text: str, reason: str | None) -> RequestOutput:
        r = live.request
        lps = None
        if r.params.logprobs is not None:
            lps = tuple(live.logprobs[len(live.logprobs) - len(new) :]) if new else ()
        return RequestOutput(
            r.request_id,
            new,
            text,
            lps,
            reason,
            r.num_prompt_tokens,
            len(r.output_token_ids),
            r.num_cached_tokens,
        )

    def drain_events(self) -> list[BlockEvent]:
        return self.pool.drain_events()

    def audit(self) -> PoolAudit:
        self.pool.check_invariants()
        return self.pool.audit()

    def block_ids_of(self, request_id: RequestId) -> list[BlockId]:
        return list(self.scheduler.requests[request_id].block_ids)
