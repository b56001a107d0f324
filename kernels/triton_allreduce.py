"""A one-kernel all-reduce for small bf16 messages between the GPUs of one host ("push + flag", the scheme
TensorRT-LLM and FlashInfer call the Lamport all-reduce), optionally fused with the residual add and RMSNorm
that follow it in a decoder layer.

Each rank stores its partial sum straight into every peer's receive buffer (symmetric memory: the peers'
buffer addresses, passed as int64), each 64-bit word holding two bf16 values and the call's 32-bit epoch, so
one store carries data and flag together and there is no barrier: the reader spins on its own local buffer
until every peer's words for this call carry this call's epoch, then sums them in rank order (the same sum,
bit for bit, on every rank).

Invariants (`LamportState` holds the device state):
- Buffer layout per rank: int64 words [2 slots, W sources, `capacity` pairs]; call e uses slot e % 2. A rank
  can be at most one call ahead of a peer (call e + 1 needs the peer's call-e + 1 push, which comes after the
  peer's call e finished on its stream), so a slot is never written for call e + 2 while call e reads it.
- A word is non-zero only between its writer's store and its reader's consumption: the reader zeroes each
  word it consumed, in the same program. So no stale word can pass as this call's, whatever the epoch
  (which is checked too; it runs from 1 and wraps before 2**30, skipping 0).
- The epoch advances on the device: every program reads it at its start, and the last program of the grid
  to finish (an atomic count) moves it on, so CUDA-graph replays need no host help. Every rank makes the same
  calls with the same grids in the same order (the model's invariant), so the ranks' epochs agree.
- A spin is bounded by `max_polls` polls of the local buffer; a program that runs out sets the error word
  (in pinned host memory on a GPU: `LamportState.failed` reads it without waiting on the device) and carries
  on with whatever it read, so a dead peer never hangs the stream; the engine is down then (dist.py's
  invariants).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

EPOCH_WRAP = 1 << 30
_EPOCH_WRAP = tl.constexpr(EPOCH_WRAP)
PLAIN_PAIRS = 1024
"""Pairs of bf16 values per program of a plain (unfused) all-reduce: 4 programs for one 4,096-wide row."""


@triton.jit
def _unpack(pairs):
    # int32 [N] pairs of bf16 bits (element 2j in the low half) -> two fp32 [N]: even and odd elements
    return (pairs << 16).to(tl.float32, bitcast=True), (pairs & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _pack(lo, hi):
    # two fp32 [N] -> int32 [N] of their bf16 roundings (round to nearest even), lo in the low half
    lo16 = lo.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi16 = hi.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32)
    return lo16 | (hi16 << 16)


@triton.jit
def _lamport_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, bufs_ptr, state_ptr, error_addr,
    row_pairs, total_pairs, capacity, rank, max_polls, n_cols, eps,
    WORLD: tl.constexpr, NORM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # x, res, w, out: int32 views of bf16 pairs; row `pid` is pairs [pid * row_pairs, (pid + 1) * row_pairs)
    # of the flat tensor. bufs: int64 [WORLD] every rank's buffer address; state: int32 [epoch, done];
    # error_addr: the address of an int32 in host memory on a GPU (pinned, mapped: the host reads it without a
    # sync; passed as an integer, as the buffers are, since it is not device memory)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    flat = row * row_pairs + offs
    mask = (offs < row_pairs) & (flat < total_pairs)
    epoch = tl.load(state_ptr, volatile=True).to(tl.int64)
    slot = (epoch & 1) * WORLD * capacity
    mine = tl.load(x_ptr + flat, mask=mask, other=0)
    if NORM:  # loaded before the spin, so that their latency hides behind the peers' pushes
        res = tl.load(res_ptr + flat, mask=mask, other=0)
        w_lo, w_hi = _unpack(tl.load(w_ptr + offs, mask=mask, other=0))
    word = (epoch << 32) | (mine.to(tl.int64) & 0xFFFFFFFF)
    for q in tl.static_range(WORLD):
        if q != rank:
            peer = tl.load(bufs_ptr + q).to(tl.pointer_type(tl.int64))
            tl.store(peer + slot + rank * capacity + flat, word, mask=mask)
    local = tl.load(bufs_ptr + rank).to(tl.pointer_type(tl.int64))
    acc_lo = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_hi = tl.zeros((BLOCK,), dtype=tl.float32)
    for q in tl.static_range(WORLD):
        if q == rank:
            vals = mine
        else:
            src = local + slot + q * capacity + flat
            got = tl.load(src, mask=mask, other=0, volatile=True)
            pending = tl.sum(tl.where(mask & ((got >> 32) != epoch), 1, 0))
            polls = 0
            while (pending > 0) & (polls < max_polls):
                got = tl.load(src, mask=mask, other=0, volatile=True)
                pending = tl.sum(tl.where(mask & ((got >> 32) != epoch), 1, 0))
                polls += 1
            if pending > 0:
                tl.store(error_addr.to(tl.pointer_type(tl.int32)), 1)
            tl.store(src, tl.zeros_like(got), mask=mask)
            vals = (got & 0xFFFFFFFF).to(tl.int32)
        lo, hi = _unpack(vals)
        acc_lo += lo
        acc_hi += hi
    # the sum rounded to bf16, as NCCL's and torch's all-reduce return it
    s_lo = acc_lo.to(tl.bfloat16).to(tl.float32)
    s_hi = acc_hi.to(tl.bfloat16).to(tl.float32)
    if NORM:
        # as kernels/triton_fused.py's add + RMSNorm: the sum rounded to the stream's dtype, normalised in
        # fp32, rounded, then scaled by the weight
        r_lo, r_hi = _unpack(res)
        h_lo = (s_lo + r_lo).to(tl.bfloat16).to(tl.float32)
        h_hi = (s_hi + r_hi).to(tl.bfloat16).to(tl.float32)
        tl.store(res_ptr + flat, _pack(h_lo, h_hi), mask=mask)
        rstd = tl.math.rsqrt(tl.sum(h_lo * h_lo + h_hi * h_hi, 0) / n_cols + eps)
        n_lo = (h_lo * rstd).to(tl.bfloat16).to(tl.float32) * w_lo
        n_hi = (h_hi * rstd).to(tl.bfloat16).to(tl.float32) * w_hi
        tl.store(out_ptr + flat, _pack(n_lo, n_hi), mask=mask)
    else:
        tl.store(out_ptr + flat, _pack(s_lo, s_hi), mask=mask)
    # relaxed: no fence behind the pushes (the next launch sees the counters anyway); the spin's exit, which
    # needs the epoch read above, orders that read before this
    done = tl.atomic_add(state_ptr + 1, 1, sem="relaxed")
    if done == tl.num_programs(0) - 1:
        tl.store(state_ptr + 1, 0)
        nxt = epoch.to(tl.int32) + 1
        tl.store(state_ptr, tl.where(nxt >= _EPOCH_WRAP, 1, nxt))


@dataclass(frozen=True)
class LamportState:
    """One rank's view of the symmetric buffers and the device counters (the module's invariants).

    `buffer`: this rank's int64 [2 * world * capacity] words, zeroed; `addresses`: int64 [world] every rank's
    buffer address on this device, in rank order; `state`: int32 [2] (epoch, programs done) = (1, 0) at
    start; `error`: int32 [1], pinned host memory on a GPU, 1 once a spin ran out of polls. `max_polls`:
    polls of one spin before it gives up."""

    buffer: torch.Tensor
    addresses: torch.Tensor
    state: torch.Tensor
    error: torch.Tensor
    rank: int
    world: int
    capacity: int
    max_polls: int

    @classmethod
    def create(cls, buffer: torch.Tensor, addresses: list[int], rank: int, max_polls: int) -> LamportState:
        world = len(addresses)
        assert buffer.dtype == torch.int64 and buffer.dim() == 1 and buffer.numel() % (2 * world) == 0, (
            f"the buffer must be int64 [2 * {world} * capacity], got {buffer.dtype} {tuple(buffer.shape)}"
        )
        assert 0 <= rank < world and addresses[rank] == buffer.data_ptr(), (rank, addresses)
        buffer.zero_()
        dev = buffer.device
        state = torch.tensor([1, 0], dtype=torch.int32, device=dev)
        error = torch.zeros(1, dtype=torch.int32, pin_memory=dev.type == "cuda")
        ptrs = torch.tensor(addresses, dtype=torch.int64, device=dev)
        return cls(buffer, ptrs, state, error, rank, world, buffer.numel() // (2 * world), max_polls)

    @property
    def max_elements(self) -> int:
        """Largest all-reduce, in bf16 values."""
        return 2 * self.capacity

    def fits(self, x: torch.Tensor) -> bool:
        """Whether `x` can go through this path: bf16, contiguous, an even count within the buffer."""
        n = x.numel()
        return (
            x.dtype == torch.bfloat16
            and x.is_contiguous()
            and n % 2 == 0
            and 0 < n <= self.max_elements
            and x.device == self.buffer.device
        )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x (bf16, `fits(x)`) over the ranks into x (in place) and returns it."""
        return all_reduce(self, x)

    def all_reduce_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The module's `all_reduce_add_rms_norm` over this rank's buffers."""
        return all_reduce_add_rms_norm(self, x, residual, weight, eps)

    def failed(self) -> bool:
        """Whether a spin has run out of polls (a host read: no wait on the device, though a kernel still
        queued may set it later)."""
        return bool(self.error[0])


def all_reduce(st: LamportState, x: torch.Tensor) -> torch.Tensor:
    """Sums x (bf16, `st.fits(x)`) over the ranks into x (in place) and returns it."""
    pairs = x.view(-1).view(torch.int32)  # [n / 2] bf16 pairs
    n_pairs = pairs.numel()
    grid = (triton.cdiv(n_pairs, PLAIN_PAIRS),)
    _lamport_kernel[grid](
        pairs, pairs, pairs, pairs, st.addresses, st.state, st.error.data_ptr(),
        PLAIN_PAIRS, n_pairs, st.capacity, st.rank, st.max_polls, 2 * PLAIN_PAIRS, 0.0,
        WORLD=st.world, NORM=False, BLOCK=PLAIN_PAIRS, num_warps=4,
    )  # fmt: skip
    return x


def all_reduce_add_rms_norm(
    st: LamportState, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, E] this rank's partial sum, residual: [T, E] (both bf16, contiguous, E even), weight: [E].
    residual += sum over ranks of x, in place (rounded to bf16); returns (rms_norm(residual) * weight,
    residual), as all_reduce then add_rms_norm would. x is left as it was."""
    n_rows, n_cols = x.shape
    assert residual.shape == x.shape and residual.is_contiguous() and residual.dtype == x.dtype, (
        f"residual {residual.dtype} {tuple(residual.shape)} must be contiguous {x.dtype} {tuple(x.shape)}"
    )
    assert weight.shape == (n_cols,) and weight.is_contiguous() and weight.dtype == x.dtype, (
        f"weight must be contiguous {x.dtype} [{n_cols}], got {weight.dtype} {tuple(weight.shape)}"
    )
    assert st.fits(x) and n_cols % 2 == 0, f"x {x.dtype} {tuple(x.shape)} does not fit the buffer"
    out = torch.empty_like(x)
    if n_rows == 0:
        return out, residual
    row_pairs = n_cols // 2
    block = triton.next_power_of_2(row_pairs)
    warps = max(4, min(16, block // 256))
    _lamport_kernel[(n_rows,)](
        x.view(torch.int32), residual.view(torch.int32), weight.view(torch.int32), out.view(torch.int32),
        st.addresses, st.state, st.error.data_ptr(), row_pairs, n_rows * row_pairs, st.capacity, st.rank,
        st.max_polls, n_cols, eps, WORLD=st.world, NORM=True, BLOCK=block, num_warps=warps,
    )  # fmt: skip
    return out, residual
