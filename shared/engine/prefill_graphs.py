"""Short prefill steps of one sequence replayed from captured CUDA graphs: up to the largest bucket of new
tokens over any cached context (a short prompt, or a short suffix over a prefix held in the pool).

Why: an eager step launches about ten kernels per layer from Python, and for a few new tokens that host
work is several times the GPU's (docs/benchmarks.md, "Prefix reuse across nodes and the host tier"); it is
exactly the step of a short prompt's TTFT and of a prefix held elsewhere.

Invariants: those of DecodeGraphs (shared/engine/cuda_graphs.py): a graph holds the addresses of the
weights, the KV tensor and this module's static buffers, none of which moves while graphs exist. A step
of n tokens replays the smallest bucket b >= n; rows n..b are padding (token 0, position 0, slot -1, so no
KV is written) and query_start_loc = [0, n] keeps them out of attention (query rows past n are masked and
never read). The metadata inside a graph says max_query_len = b and max_seq_len = max_model_len, so the
attention's tiles and split count depend on the bucket alone, and stay correct for any shorter context.
Logits come from row n - 1 only, through an index in a static buffer. On CPU the same buffers and
padding run eagerly (the test path).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from pdserve.kernels.ops import AttentionMetadata
from pdserve.shared.engine.cuda_graphs import GraphSet, pick_bucket


class PrefillGraphs(GraphSet):
    """Single-sequence prefill steps of up to `buckets[-1]` new tokens replayed from captured graphs, one per
    token bucket (`prefill_buckets(max_num_batched_tokens)`)."""

    kind = "prefill"

    def _stage_buffers(self, max_b: int) -> None:
        dev, pin = self.kv_cache.device, self._pin
        # host staging -> device copies: rows of _i64 are input ids, positions, slots; _i32 holds
        # query_start_loc [0, n] and the sequence's length; _last the row whose logits are taken
        self._h_i64 = torch.zeros((3, max_b), dtype=torch.int64, pin_memory=pin)
        self._h_i64[2].fill_(-1)
        self._h_i32 = torch.ones(3, dtype=torch.int32, pin_memory=pin)
        self._h_i32[0] = 0
        self._h_last = torch.zeros(1, dtype=torch.int64, pin_memory=pin)
        self._h_tab = torch.zeros((1, self.width), dtype=torch.int32, pin_memory=pin)
        self._i64 = self._h_i64.to(dev, copy=True)
        self._i32 = self._h_i32.to(dev, copy=True)
        self._last = self._h_last.to(dev, copy=True)
        self._tab = self._h_tab.to(dev, copy=True)

    def _forward_fn(self, b: int, argmax: bool) -> Callable[[], torch.Tensor]:
        meta = AttentionMetadata(
            positions=self._i64[1, :b],
            slot_mapping=self._i64[2, :b],
            query_start_loc=self._i32[:2],
            seq_lens=self._i32[2:],
            block_tables=self._tab,
            max_query_len=b,
            max_seq_len=self.max_model_len,
            rope=self.model.rope,
        )

        def fn() -> torch.Tensor:
            hidden = self.model.forward(self._i64[0, :b], self.kv_cache, meta, self.ops)
            return self._output(hidden.index_select(0, self._last), argmax)  # [1, V] fp32 or [1] int64

        return fn

    def fits(self, num_tokens: int, seq_len: int) -> bool:
        """Whether one sequence's step of `num_tokens` new tokens ending at `seq_len` can replay."""
        return bool(self.buckets) and 1 <= num_tokens <= self.buckets[-1] and seq_len <= self.max_model_len

    def run(
        self,
        token_ids: Sequence[int],
        start: int,
        num_tokens: int,
        block_ids: Sequence[int],
        argmax: bool = False,
    ) -> torch.Tensor:
        """Tokens [start, start + num_tokens) of `token_ids` over the sequence's cached [0, start), whose
        blocks are `block_ids`; writes their KV and returns fp32 logits [1, V] of the last one, or with
        `argmax` its greedy token [1] int64 (a copy, so the next replay cannot change it)."""
        end, bs = start + num_tokens, self.block_size
        assert self.fits(num_tokens, end), f"{num_tokens} new tokens ending at {end}: does not fit"
        assert len(block_ids) * bs >= end, f"blocks cover {len(block_ids) * bs} tokens, need {end}"
        b = pick_bucket(self.buckets, num_tokens)
        bucket = self._bucket(b, argmax)
        i64, i32, tab = self._h_i64.numpy(), self._h_i32.numpy(), self._h_tab.numpy()
        used = -(-end // bs)
        tab[0, :used] = block_ids[:used]  # later columns keep earlier valid block ids (never read)
        i64[0, :num_tokens] = token_ids[start:end]
        i64[1, :num_tokens] = range(start, end)
        i64[2, :num_tokens] = [block_ids[p // bs] * bs + p % bs for p in range(start, end)]
        i64[0, num_tokens:b], i64[1, num_tokens:b], i64[2, num_tokens:b] = 0, 0, -1
        i32[:] = (0, num_tokens, end)
        self._h_last[0] = num_tokens - 1
        for dst, src in ((self._i64, self._h_i64), (self._i32, self._h_i32), (self._last, self._h_last)):
            dst.copy_(src, non_blocking=True)
        self._tab[:, :used].copy_(self._h_tab[:, :used], non_blocking=True)
        if self._fence is not None:
            self._fence.record()
        bucket.replay()
        return bucket.logits.clone()
