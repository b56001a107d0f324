"""Steps under CUDA graphs: `GraphSet`, what every kind shares (static buffers, one graph per bucket, one
private pool); decode, one captured forward + logits per batch-size bucket; and the GPU memory plan that
sizes the KV pool with room left for the graphs (the short-prefill kind is shared/engine/prefill_graphs.py).

Invariants: a graph holds the addresses of the weights, the KV tensor and this module's static buffers,
so none of them moves or is freed while graphs exist (the KV pool is allocated once, before capture, and
never moves; blocks changing hands in the pool change only table contents, never addresses). A batch of
n rows replays the smallest bucket >= n; rows n.. of the bucket are padding (token 0, position 0, slot -1
so no KV is written, seq_len 1 over a table row of valid block ids) and their logits are dropped. The
metadata inside a graph says max_seq_len = max_model_len, so the decode kernel's split count depends on
the bucket alone, never on the batch replayed. At tensor-parallel size > 1 every bucket has two graphs, one
ending in the logits gathered on rank 0 and one in the greedy tokens (`LlamaModel.greedy_tokens`: only each
rank's best per row is exchanged); every rank replays the same one, as the step message says. Everything
captured lives in one private memory pool that
`close()` gives back; `close()` is idempotent. On CPU the same buffers and padding run eagerly (the test
path).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from pdserve.kernels.ops import AttentionMetadata, AttentionOps
from pdserve.shared.model.model import LlamaModel

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

log = logging.getLogger(__name__)

MIB = 1 << 20
GRAPH_OVERHEAD_BYTES = 16 * MIB
"""Per captured graph, beyond its activations: an estimate (executable graph, cuBLAS workspace)."""
PREFILL_TOKEN_BUCKETS = (16, 64, 256, 512)
"""New-token counts of the single-sequence prefill graphs (shared/engine/prefill_graphs.py): past about 512
tokens a step's GPU work hides its launches."""
SAMPLER_COPIES = 4
"""The sampler holds at most this many fp32 [max_num_seqs, V] tensors at once: an estimate."""


def bucket_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Powers of two below max_num_seqs, then max_num_seqs itself: (1, 2, 4, ..., max_num_seqs)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs}: must be >= 1")
    sizes = []
    b = 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return (*sizes, max_num_seqs)


def prefill_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    """The token buckets of the prefill graphs (PREFILL_TOKEN_BUCKETS) a step budget of
    max_num_batched_tokens can use."""
    return tuple(b for b in PREFILL_TOKEN_BUCKETS if b <= max_num_batched_tokens)


def pick_bucket(buckets: Sequence[int], n: int) -> int:
    """The smallest bucket >= n; buckets ascending."""
    i = bisect.bisect_left(buckets, n)
    if n < 1 or i == len(buckets):
        raise ValueError(f"batch of {n} rows: accepted 1..{buckets[-1]}")
    return buckets[i]


class _Bucket(Protocol):
    logits: torch.Tensor  # [bucket, V] fp32 (the greedy variant: [bucket] int64 tokens), valid after replay()

    def replay(self) -> None: ...


class _GraphBucket:
    def __init__(self, fn: Callable[[], torch.Tensor], pool: _POOL_HANDLE) -> None:
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = fn()

    def replay(self) -> None:
        self.graph.replay()


class _EagerBucket:
    def __init__(self, fn: Callable[[], torch.Tensor]) -> None:
        self._fn = fn
        self.logits = torch.empty(0)

    def replay(self) -> None:
        self.logits = self._fn()


class GraphSet:
    """One kind of step replayed from graphs, one graph per bucket (ascending), over one model, KV tensor
    and ops. A subclass allocates its static buffers for the largest bucket (`_stage_buffers`) and builds a
    bucket's forward (`_forward_fn`, ending in the logits or, with `argmax`, the greedy tokens); `close()`
    gives the graphs and their pool back and is idempotent.
    `capture=False` runs the same static-buffer path eagerly (CPU, and the oracle for the graph path in
    tests). Build it after the weights are loaded and the KV tensor is allocated."""

    kind = ""  # what the log line calls these steps

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: torch.Tensor,
        ops: AttentionOps,
        *,
        block_size: int,
        max_model_len: int,
        buckets: tuple[int, ...],
        capture: bool,
    ) -> None:
        dev = kv_cache.device
        assert not capture or dev.type == "cuda", f"CUDA graphs need a CUDA KV cache, got {dev}"
        assert list(buckets) == sorted(set(buckets)), f"buckets must ascend, got {buckets}"
        self.model, self.kv_cache, self.ops = model, kv_cache, ops
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.buckets = buckets
        self.width = -(-max_model_len // block_size)  # block-table columns
        self._pin = dev.type == "cuda"  # staging buffers in pinned memory, copied without a sync
        self._fence = torch.cuda.Event() if self._pin else None
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._stage_buffers(max(buckets, default=1))
        graphs: dict[tuple[int, bool], _Bucket] = {}
        start, reserved = time.perf_counter(), _reserved(dev)
        with torch.inference_mode():
            # largest first: smaller graphs reuse its pool memory
            for b, argmax in [(b, a) for b in reversed(buckets) for a in graph_variants(model)]:
                fn = self._forward_fn(b, argmax)
                if self._pool is None:
                    graphs[b, argmax] = _EagerBucket(fn)
                    continue
                for _ in range(2):  # compile Triton kernels and create cuBLAS handles outside the capture
                    fn()
                torch.cuda.synchronize(dev)
                graphs[b, argmax] = _GraphBucket(fn, self._pool)
        self._graphs: dict[tuple[int, bool], _Bucket] | None = graphs
        self.pool_bytes = _reserved(dev) - reserved
        """Device memory the capture took (graph pool and workspaces), measured; 0 on CPU."""
        log.info(
            "%s %s for buckets %s in %.1f s, %.0f MiB",
            self.kind, "graphs captured" if capture else "buckets built (eager)",
            buckets, time.perf_counter() - start, self.pool_bytes / MIB,
        )  # fmt: skip

    def _stage_buffers(self, max_bucket: int) -> None:
        raise NotImplementedError

    def _forward_fn(self, b: int, argmax: bool) -> Callable[[], torch.Tensor]:
        raise NotImplementedError

    def _output(self, hidden: torch.Tensor, argmax: bool) -> torch.Tensor:
        """The step's result from the rows that sample, hidden [S, E]: logits [S, V] fp32, or with `argmax`
        the greedy tokens [S] int64."""
        if argmax:
            return self.model.greedy_tokens(hidden, self.ops)
        return self.model.compute_logits(hidden, self.ops)

    def _bucket(self, b: int, argmax: bool) -> _Bucket:
        """Bucket b's graph, once the previous step's staging copies have left the host buffers."""
        if self._graphs is None:
            raise RuntimeError(f"{type(self).__name__}.run after close()")
        if self._fence is not None:
            self._fence.synchronize()
        return self._graphs[b, argmax]

    def close(self) -> None:
        """Drops every graph and the private pool; a later `run` raises. Idempotent."""
        graphs, self._graphs = self._graphs, None
        if graphs is None:
            return
        self._pool = None
        for bucket in graphs.values():
            if isinstance(bucket, _GraphBucket):
                bucket.graph.reset()
        graphs.clear()
        if self.kv_cache.device.type == "cuda":
            torch.cuda.synchronize(self.kv_cache.device)
            # capture ran matmuls on a side stream, whose cuBLAS workspace would stay allocated for good
            torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()


class DecodeGraphs(GraphSet):
    """Pure-decode steps (one new token per sequence) replayed from captured graphs, one per batch-size
    bucket (`bucket_sizes(max_num_seqs)`)."""

    kind = "decode"

    def _stage_buffers(self, max_bs: int) -> None:
        dev, pin = self.kv_cache.device, self._pin
        # host staging -> device copies; rows of _i64: input ids, positions, slots, and the row of the
        # previous step's sampled tokens a row takes its input id from on the device (-1: none)
        self._h_i64 = torch.zeros((4, max_bs), dtype=torch.int64, pin_memory=pin)
        self._h_seq = torch.ones(max_bs, dtype=torch.int32, pin_memory=pin)
        self._h_tab = torch.zeros((max_bs, self.width), dtype=torch.int32, pin_memory=pin)
        self._h_i64[2].fill_(-1)
        self._i64 = self._h_i64.to(dev, copy=True)
        self._seq = self._h_seq.to(dev, copy=True)
        self._tab = self._h_tab.to(dev, copy=True)
        self._qsl = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)

    def _forward_fn(self, b: int, argmax: bool) -> Callable[[], torch.Tensor]:
        meta = AttentionMetadata(
            positions=self._i64[1, :b],
            slot_mapping=self._i64[2, :b],
            query_start_loc=self._qsl[: b + 1],
            seq_lens=self._seq[:b],
            block_tables=self._tab[:b],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            rope=self.model.rope,
        )

        def fn() -> torch.Tensor:
            hidden = self.model.forward(self._i64[0, :b], self.kv_cache, meta, self.ops)
            return self._output(hidden, argmax)  # [b, V] fp32 or [b] int64

        return fn

    def fits(self, seq_lens: Sequence[int]) -> bool:
        """Whether a decode batch with these context lengths (new token included) can replay."""
        return 0 < len(seq_lens) <= self.buckets[-1] and max(seq_lens) <= self.max_model_len

    def run(
        self,
        input_ids: Sequence[int],
        block_ids: Sequence[Sequence[int]],
        seq_lens: Sequence[int],
        from_device: tuple[Sequence[tuple[int, int]], torch.Tensor] | None = None,
        argmax: bool = False,
    ) -> torch.Tensor:
        """One decode step: row i feeds token input_ids[i] at position seq_lens[i] - 1 of a sequence whose
        blocks are block_ids[i]; `from_device` = (pairs (row, j), tokens) replaces row's input with
        tokens[j] on the device (the previous step's sample, never read back). Returns fp32 logits [n, V],
        or with `argmax` (tensor-parallel size > 1) the greedy tokens [n] int64 (a copy, so the next replay
        cannot change it)."""
        n = len(input_ids)
        assert len(block_ids) == n == len(seq_lens), (n, len(block_ids), len(seq_lens))
        assert self.fits(seq_lens), f"batch of {n} rows, longest context {max(seq_lens)}: does not fit"
        b = pick_bucket(self.buckets, n)
        bucket = self._bucket(b, argmax)
        self._stage(input_ids, block_ids, seq_lens, b)
        if from_device is not None:
            src = self._h_i64.numpy()[3]
            src[:n] = -1
            for row, j in from_device[0]:
                src[row] = j
        self._i64.copy_(self._h_i64, non_blocking=True)
        self._seq[:b].copy_(self._h_seq[:b], non_blocking=True)
        self._tab[:b].copy_(self._h_tab[:b], non_blocking=True)
        if from_device is not None:
            tokens = from_device[1]
            src = self._i64[3, :n]
            ids = self._i64[0, :n]
            ids.copy_(torch.where(src >= 0, tokens[src.clamp(min=0)], ids))
        if self._fence is not None:
            self._fence.record()
        bucket.replay()
        return bucket.logits[:n].clone()

    def _stage(
        self, input_ids: Sequence[int], block_ids: Sequence[Sequence[int]], seq_lens: Sequence[int], b: int
    ) -> None:
        n, bs = len(input_ids), self.block_size
        i64, seq, tab = self._h_i64.numpy(), self._h_seq.numpy(), self._h_tab.numpy()
        positions = [s - 1 for s in seq_lens]
        slots = []
        for i, (pos, blocks) in enumerate(zip(positions, block_ids, strict=True)):
            used = pos // bs + 1
            assert len(blocks) >= used, f"row {i}: {len(blocks)} blocks cannot hold position {pos}"
            tab[i, :used] = blocks[:used]
            slots.append(blocks[pos // bs] * bs + pos % bs)
        i64[0, :n], i64[1, :n], i64[2, :n] = input_ids, positions, slots
        seq[:n] = seq_lens
        # padding rows; their table rows keep earlier valid block ids (all entries ever written are)
        i64[0, n:b], i64[1, n:b], i64[2, n:b] = 0, 0, -1
        seq[n:b] = 1


def graph_variants(model: LlamaModel) -> tuple[bool, ...]:
    """The `argmax` values a graph set captures per bucket: a group of one samples from its own logits."""
    return (False,) if model.tp.size == 1 else (False, True)


def _reserved(dev: torch.device) -> int:
    if dev.type != "cuda":
        return 0
    torch.cuda.synchronize(dev)
    return torch.cuda.memory_reserved(dev)


@dataclass(frozen=True)
class GpuMemoryPlan:
    """Bytes on one GPU, measured after the weights loaded (estimates are named as such)."""

    total: int
    used_before_kv: int  # on the device (weights, CUDA context, other processes) before the KV pool
    activation_peak: int  # measured: the larger of a full-budget prefill and a max-batch decode forward
    graph_reserve: int  # estimate: the max-batch decode peak plus GRAPH_OVERHEAD_BYTES per graph
    sampler_reserve: int  # estimate: SAMPLER_COPIES fp32 [max_num_seqs, V]
    kv_bytes: int  # what the pool may take: total * utilization minus everything above

    def num_blocks(self, bytes_per_block: int) -> int:
        return self.kv_bytes // bytes_per_block


@torch.inference_mode()
def plan_gpu_memory(
    model: LlamaModel,
    ops: AttentionOps,
    *,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    utilization: float,
    cuda_graphs: bool,
    kv_dtype: torch.dtype,
) -> GpuMemoryPlan:
    """Runs a prefill of the whole token budget and a decode at max_num_seqs over a scratch KV cache (in
    the pool's dtype, so the kernels profiled are the ones served), measures their peak allocation, frees
    the scratch, and says how many bytes the KV pool may take."""
    c = model.config
    dev = model.embed_weight.device
    prefill_len = min(max_num_batched_tokens, max_model_len)
    scratch_blocks = -(-prefill_len // block_size) + 1
    scratch = torch.zeros(
        (c.num_layers, 2, scratch_blocks, block_size, model.tp.num_kv_heads, c.head_dim),
        dtype=kv_dtype,
        device=dev,
    )
    prefill = _profile_peak(model, ops, scratch, [prefill_len], min(max_num_seqs, prefill_len))
    decode = _profile_peak(model, ops, scratch, [1] * max_num_seqs, max_num_seqs)
    # the prefill graphs (shared/engine/prefill_graphs.py): one sequence, their largest bucket of tokens
    short = prefill_buckets(max_num_batched_tokens)
    short_peak = _profile_peak(model, ops, scratch, [short[-1]], 1) if cuda_graphs and short else 0
    del scratch
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    n_graphs = (
        (len(bucket_sizes(max_num_seqs)) + len(short)) * len(graph_variants(model)) if cuda_graphs else 0
    )
    graph_reserve = decode + short_peak + GRAPH_OVERHEAD_BYTES * n_graphs if cuda_graphs else 0
    sampler = SAMPLER_COPIES * max_num_seqs * c.vocab_size * 4
    used = total - free
    kv = int(total * utilization) - used - max(prefill, decode) - graph_reserve - sampler
    if kv <= 0:
        raise RuntimeError(
            f"no GPU memory left for the KV pool: {used / MIB:.0f} MiB used of {total / MIB:.0f} MiB, "
            f"activations {max(prefill, decode) / MIB:.0f} MiB, graphs {graph_reserve / MIB:.0f} MiB; "
            f"raise gpu_memory_utilization ({utilization}) or lower max_num_batched_tokens/max_num_seqs"
        )
    return GpuMemoryPlan(total, used, max(prefill, decode), graph_reserve, sampler, kv)


def _profile_peak(
    model: LlamaModel, ops: AttentionOps, kv: torch.Tensor, q_lens: list[int], n_logits: int
) -> int:
    """Peak bytes allocated above the current level by one forward of sequences with q_lens new tokens
    (no cached prefix) plus logits for n_logits rows. Slots wrap inside the scratch cache."""
    dev = kv.device
    n_blocks, block_size = kv.shape[2], kv.shape[3]
    n_tokens = sum(q_lens)
    width = -(-max(q_lens) // block_size)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        positions=torch.cat([torch.arange(q, device=dev) for q in q_lens]),
        slot_mapping=torch.arange(n_tokens, device=dev) % (n_blocks * block_size),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(q_lens, dtype=torch.int32, device=dev),
        block_tables=torch.arange(width, dtype=torch.int32, device=dev).repeat(len(q_lens), 1),
        max_query_len=max(q_lens),
        max_seq_len=max(q_lens),
        rope=model.rope,
    )
    input_ids = torch.zeros(n_tokens, dtype=torch.int64, device=dev)
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    hidden = model.forward(input_ids, kv, meta, ops)
    model.compute_logits(hidden[:n_logits])
    torch.cuda.synchronize(dev)
    return torch.cuda.max_memory_allocated(dev) - base
