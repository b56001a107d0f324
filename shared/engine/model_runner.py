"""Owns the KV cache tensor and turns one scheduled batch into a forward pass and logits (or, for a step
whose rows are all plain greedy at tensor-parallel size > 1, the greedy tokens: `execute(argmax=True)`).

Invariants: the KV tensor is allocated once, `[num_layers, 2, num_blocks, block_size, Hkv, D]`, and never
moves (transfer connectors and CUDA graphs hold its address); a token's KV goes to slot
`block_ids[pos // block_size] * block_size + pos % block_size` of its request; the runner reads the
scheduler's decisions and never changes request state. An item whose input is the previous step's sampled
token (`prev_row`, overlap) reads it from that step's token tensor on the device, never from the host.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from pdserve.kernels.ops import AttentionMetadata, AttentionOps, get_ops
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.cuda_graphs import DecodeGraphs, bucket_sizes, plan_gpu_memory, prefill_buckets
from pdserve.shared.engine.prefill_graphs import PrefillGraphs
from pdserve.shared.model.loader import LoadedModel

log = logging.getLogger(__name__)

TABLE_ALIGN = 16
"""Block-table columns of an eager step are a multiple of this (one kernel specialization for all widths)."""


@dataclass(frozen=True)
class BatchItem:
    """One sequence's share of a step: tokens [start, start + num_tokens) of `token_ids`."""

    token_ids: Sequence[int]
    start: int
    num_tokens: int
    block_ids: Sequence[int]
    sample: bool
    prev_row: int = -1
    """>= 0: the item's one token is row `prev_row` of the previous step's sampled tokens (still on the
    device; `token_ids` ends before it)."""


def kv_bytes_per_block(loaded: LoadedModel, cfg: EngineConfig) -> int:
    """Bytes of one block on this rank (its KV heads: all of them at TP=1)."""
    c = loaded.config
    elem = torch.empty((), dtype=cfg.torch_kv_dtype).element_size()
    return c.num_layers * 2 * cfg.block_size * loaded.model.tp.num_kv_heads * c.head_dim * elem


def kv_pool_shape(loaded: LoadedModel, cfg: EngineConfig, num_blocks: int) -> tuple[int, ...]:
    """This rank's KV pool: [L, 2, num_blocks, B, Hkv, D] (Hkv: its KV heads)."""
    c = loaded.config
    return (c.num_layers, 2, num_blocks, cfg.block_size, loaded.model.tp.num_kv_heads, c.head_dim)


def size_kv_pool(cfg: EngineConfig, loaded: LoadedModel, max_model_len: int) -> int:
    """Blocks of this rank's KV pool: from `kv_cache_bytes` on the CPU, from free memory on a GPU (after the
    weights, before the pool and the graphs: activations measured, capture reserved)."""
    per_block = kv_bytes_per_block(loaded, cfg)
    device = loaded.model.embed_weight.device  # this rank's
    if device.type == "cuda":
        plan = plan_gpu_memory(
            loaded.model,
            get_ops(device),
            block_size=cfg.block_size,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=max_model_len,
            utilization=cfg.gpu_memory_utilization,
            cuda_graphs=cfg.cuda_graphs,
            kv_dtype=cfg.torch_kv_dtype,
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


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor for the KV pool. On the CPU it lies on an anonymous memory mapping, which the
    OS hands out zeroed and commits page by page on first write: a node starts without writing its whole
    pool (gigabytes of page faults at start-up), and its resident memory grows with the blocks it uses."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    try:
        mapping = mmap.mmap(-1, nbytes)
    except OSError as exc:
        raise OSError(exc.errno, f"a KV pool of {nbytes / (1 << 30):.2f} GiB: {exc.strerror}") from exc
    return torch.frombuffer(mapping, dtype=dtype).view(shape)  # the tensor keeps the mapping


_MALLOPT_TRIM_THRESHOLD, _MALLOPT_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_MMAP_THRESHOLD_MAX = 32 << 20  # the largest glibc accepts on 64-bit platforms


def _keep_freed_memory() -> None:
    """Makes glibc's malloc keep the memory a CPU step frees for the next step. By default it hands large
    blocks back to the OS as they are freed (a mapping of their own above a threshold that adapts, a heap
    top released past another), so every step faulted its activations in again page by page: 408k page
    faults and 0.85 s of system time in a 6 s 1,650-token SmolLM2 prefill. Both thresholds are raised once,
    for the whole process (a node process owns one engine); what the process keeps is at most its largest
    step's working set. Elsewhere than glibc (no `mallopt`) nothing changes."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return
    mallopt(_MALLOPT_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)  # blocks up to 32 MiB come from the heap
    mallopt(_MALLOPT_TRIM_THRESHOLD, 2**31 - 1)  # and the heap is not trimmed


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        cfg: EngineConfig,
        num_blocks: int,
        *,
        max_model_len: int | None = None,
        ops: AttentionOps | None = None,
        device: torch.device | None = None,
        kv_cache: torch.Tensor | None = None,
    ) -> None:
        """`max_model_len` defaults to the config's (capped by the model's); `ops` to `get_ops(device)`;
        `device` to the config's (a tensor-parallel rank's is `cfg.rank_device(rank)`); `kv_cache` to a
        fresh zeroed pool (a tensor-parallel worker's lies in memory rank 0 maps too)."""
        c = loaded.config
        self.model = loaded.model
        self.config = c
        self.block_size = cfg.block_size
        self.device = device or cfg.torch_device
        self.ops: AttentionOps = ops or get_ops(self.device)
        self.num_blocks = num_blocks
        self.outputs: Counter[str] = Counter()
        """Steps run, by what they returned: "logits" or "tokens" (`execute`'s `argmax`)."""
        if self.device.type == "cuda":
            # Accumulate half-precision matmuls in fp32 end to end: more exact, and for the skinny (M = 1..8)
            # decode GEMMs cuBLAS then skips its separate split-K reduction kernels. Process-wide; a node
            # process owns one engine, so this is the engine's setting, made once at construction.
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        elif self.device.type == "cpu":
            _keep_freed_memory()
        # kv_cache: [L, 2, N, B, Hkv, D], Hkv: this rank's KV heads
        shape = kv_pool_shape(loaded, cfg, num_blocks)
        assert kv_cache is None or tuple(kv_cache.shape) == shape, (kv_cache.shape, shape)
        self.kv_cache = _zeroed(shape, cfg.torch_kv_dtype, self.device) if kv_cache is None else kv_cache
        # Pure-decode steps without a layer hook replay CUDA graphs; they hold kv_cache's address, which
        # is why the pool is allocated once, before capture, and never moves.
        # Short single-sequence prefills replay graphs too (their eager launches cost more than their GPU
        # work); a layer hook then runs for every layer after the replay.
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        if cfg.cuda_graphs and self.device.type == "cuda":
            limit = min(cfg.max_model_len or c.max_position_embeddings, c.max_position_embeddings)
            m, kv, ops, bs, mml = self.model, self.kv_cache, self.ops, cfg.block_size, max_model_len or limit
            decode_buckets = bucket_sizes(cfg.max_num_seqs)
            self.graphs = DecodeGraphs(
                m, kv, ops, block_size=bs, max_model_len=mml, buckets=decode_buckets, capture=True
            )
            prefill_tokens = prefill_buckets(cfg.max_num_batched_tokens)
            self.prefill_graphs = PrefillGraphs(
                m, kv, ops, block_size=bs, max_model_len=mml, buckets=prefill_tokens, capture=True
            )
        if self.device.type == "cuda":
            self.warm_up(max_model_len or c.max_position_embeddings)

    @torch.inference_mode()
    def warm_up(self, max_model_len: int) -> None:
        """Compiles, before the node serves (construction calls it on CUDA), every kernel that an eager
        prefill step and a block copy launch (decode and short single-sequence prefills compile at graph
        capture): a 64-token prompt (cuBLAS products, single-pass attention); 16 tokens over contexts of
        1,024, 2,048, 4,096 and 8,192 (GEMV products, split attention, and the reduction of 2, 4, 8 and 16
        splits, each its own kernel); one block copied out and back. Else the first requests of each kind
        wait for Triton's compiler, seconds each, and the router's cost model learns those seconds as
        prefill time. Nothing changes: every slot is -1 (no KV written), the tables name block 0 (read,
        discarded), and block 0 is copied back onto itself while no request holds it."""
        start = time.perf_counter()
        b = self.block_size
        steps = [(0, 64)] + [(c - 16, 16) for c in (1024, 2048, 4096, 8192) if c <= max_model_len]
        for ctx_len, new in steps:
            n_blocks = -(-(ctx_len + new) // (b * TABLE_ALIGN)) * TABLE_ALIGN
            meta = AttentionMetadata(
                positions=torch.arange(ctx_len, ctx_len + new, device=self.device),
                slot_mapping=torch.full((new,), -1, dtype=torch.int64, device=self.device),
                query_start_loc=torch.tensor([0, new], dtype=torch.int32, device=self.device),
                seq_lens=torch.tensor([ctx_len + new], dtype=torch.int32, device=self.device),
                block_tables=torch.zeros((1, n_blocks), dtype=torch.int32, device=self.device),
                max_query_len=new,
                max_seq_len=ctx_len + new,
                rope=self.model.rope,
            )
            ids = torch.zeros(new, dtype=torch.int64, device=self.device)
            hidden = self.model.forward(ids, self.kv_cache, meta, self.ops)
            self.model.compute_logits(hidden[-1:], self.ops)
        block = torch.zeros(1, dtype=torch.int64, device=self.device)
        layer = self.kv_cache[0]
        buffer = torch.empty((2, 1, *layer.shape[2:]), dtype=layer.dtype, device=self.device)
        self.ops.gather_blocks(layer, block, buffer)
        self.ops.scatter_blocks(buffer, layer, block)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        log.info("prefill and block-copy kernels warmed up in %.1f s", time.perf_counter() - start)

    def close(self) -> None:
        """Releases the captured graphs and their memory pool (the KV tensor goes with the runner)."""
        for graphs in (self.graphs, self.prefill_graphs):
            if graphs is not None:
                graphs.close()

    @torch.inference_mode()
    def execute(
        self,
        items: Sequence[BatchItem],
        layer_hook: Callable[[int], None] | None = None,
        *,
        prev_tokens: torch.Tensor | None = None,
        wait: bool = True,
        argmax: bool = False,
    ) -> torch.Tensor:
        """Runs one step; returns fp32 logits [num sampled items, V] in item order (at tensor-parallel size
        > 1: on rank 0; the other ranks get their own columns back), or with `argmax` the greedy tokens
        [num sampled items] int64 on every rank (only each rank's best per row crosses ranks; every rank
        must pass the same `argmax`). `prev_tokens` [S] int64 (on the device) feeds the items with a
        `prev_row`. With `wait=False` the result may still be in the making on the device (the caller
        queues more work behind it)."""
        self.outputs["tokens" if argmax else "logits"] += 1
        fill = [(i, it.prev_row) for i, it in enumerate(items) if it.prev_row >= 0]
        from_device = None
        if fill:
            assert prev_tokens is not None, "items read the previous step's tokens: pass them"
            from_device = (fill, prev_tokens)
        if layer_hook is None and self.graphs is not None and all(it.num_tokens == 1 for it in items):
            seq_lens = [it.start + 1 for it in items]
            if self.graphs.fits(seq_lens):
                ids = [0 if it.prev_row >= 0 else it.token_ids[it.start] for it in items]
                logits = self.graphs.run(ids, [it.block_ids for it in items], seq_lens, from_device, argmax)
                keep = [i for i, it in enumerate(items) if it.sample]
                logits = logits if len(keep) == len(items) else logits[keep]
                return self._wait(logits) if wait else logits
        if self.prefill_graphs is not None and len(items) == 1 and items[0].prev_row < 0:
            it = items[0]
            if self.prefill_graphs.fits(it.num_tokens, it.start + it.num_tokens):
                logits = self.prefill_graphs.run(it.token_ids, it.start, it.num_tokens, it.block_ids, argmax)
                if layer_hook is not None:  # every layer's KV writes are queued before the hook's work
                    for layer in range(self.config.num_layers):
                        layer_hook(layer)
                logits = logits if it.sample else logits[:0]
                return self._wait(logits) if wait else logits
        input_ids, positions, slots = self._token_lists(items)
        meta = self._metadata(items, positions, slots)
        dev = self.device
        ids_t = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        if from_device is not None:
            starts = [0]
            for it in items:
                starts.append(starts[-1] + it.num_tokens)
            dst = torch.tensor([starts[i] for i, _ in fill], dtype=torch.int64, device=dev)
            src = torch.tensor([row for _, row in fill], dtype=torch.int64, device=dev)
            ids_t[dst] = from_device[1][src]
        hidden = self.model.forward(ids_t, self.kv_cache, meta, self.ops, layer_hook)
        # rows: each sampled item's last token in the flat batch, from host-side counts (no device sync)
        rows, end = [], 0
        for it in items:
            end += it.num_tokens
            if it.sample:
                rows.append(end - 1)
        picked = hidden[torch.tensor(rows, dtype=torch.int64, device=dev)]
        if argmax:
            tokens = self.model.greedy_tokens(picked, self.ops)  # [S] int64
            return self._wait(tokens) if wait else tokens
        logits = self.model.compute_logits(picked, self.ops)
        return self._wait(logits) if wait else logits

    def _wait(self, logits: torch.Tensor) -> torch.Tensor:
        """Waits for the step's GPU work with the GIL released (Stream.synchronize drops it; reading a
        tensor back would hold it), so the node's asyncio thread (KV frames, token streams) runs meanwhile."""
        if logits.is_cuda:
            torch.cuda.current_stream(logits.device).synchronize()
        return logits

    def _token_lists(self, items: Sequence[BatchItem]) -> tuple[list[int], list[int], list[int]]:
        b = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for it in items:
            end = it.start + it.num_tokens
            assert len(it.block_ids) * b >= end, f"blocks cover {len(it.block_ids) * b} tokens, need {end}"
            if it.prev_row >= 0:
                assert it.num_tokens == 1, "a token still on the device is a step's only token"
                input_ids.append(0)  # replaced on the device
            else:
                input_ids.extend(it.token_ids[it.start : end])
            positions.extend(range(it.start, end))
            slots.extend(it.block_ids[p // b] * b + p % b for p in range(it.start, end))
        return input_ids, positions, slots

    def _metadata(
        self, items: Sequence[BatchItem], positions: list[int], slots: list[int]
    ) -> AttentionMetadata:
        dev = self.device
        starts = [0]
        for it in items:
            starts.append(starts[-1] + it.num_tokens)
        seq_lens = [it.start + it.num_tokens for it in items]
        # Columns padded to a multiple of TABLE_ALIGN: Triton specializes a kernel on whether an int argument
        # (the table's row stride) divides by 16, so a ragged width compiled a second attention kernel the
        # first time a mixed batch ran (a compile stall mid-serving). Padding entries are never read.
        width = -(-max(len(it.block_ids) for it in items) // TABLE_ALIGN) * TABLE_ALIGN
        table = [list(it.block_ids) + [0] * (width - len(it.block_ids)) for it in items]
        return AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(table, dtype=torch.int32, device=dev),
            max_query_len=max(it.num_tokens for it in items),
            max_seq_len=max(seq_lens),
            rope=self.model.rope,
        )
